"""Remote storage: ``s3://``, ``gs://``, ``http(s)://`` and ``hf://`` paths read through fsspec
(:mod:`.fs`), the stores, retries and settings behind it (:mod:`.store`), the size-bounded local
cache (:mod:`.cache`) and whole-file HTTP downloads (:mod:`.http`)."""
