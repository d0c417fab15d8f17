"""WebDataset shards: URL patterns and the sample stream (:mod:`.shards`), the sample-count index
(:mod:`.index`), where a split's shards are and their random-access view (:mod:`.layout`),
training streams (:mod:`.stream`) with their local spool (:mod:`.spool`), and writing shards
(:mod:`.prepare`)."""
