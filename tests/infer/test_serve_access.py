"""A service you can put in front of people, against ``vitflow serve`` on 127.0.0.1: API keys
(open health checks, 401, both headers, reload on SIGHUP under load, failed attempts limited and
counted), TLS with a client that checks the certificate, the schema fuzzed by Schemathesis, and
the page driven in headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from helpers import ENV, HYMENOPTERA_TAR, encode
from serve_helpers import Clients, Served, wait_until
from servers import self_signed_cert
from vitflow.infer import Predictor, collect_images
from vitflow.infer.serve.auth import FAILURES, FailureLimit, KeyFileError, read_keys
from vitflow.infer.serve.server import access, check_tls
from vitflow.infer.serve.settings import ServeSettings

KEY_A, KEY_B, KEY_C = "team-a-0123456789abcdef", "team-b-0123456789abcdef", "team-c-0123456789abcdef"


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    """One real JPEG (a hymenoptera photo where the shared data is, else a made-up one)."""
    folder = tmp_path_factory.mktemp("photo")
    if HYMENOPTERA_TAR.exists():
        import tarfile

        with tarfile.open(HYMENOPTERA_TAR) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(".jpg") and "/val/bees/" in m.name)
            (folder / "bee.jpg").write_bytes(tar.extractfile(member).read())
    else:
        import numpy as np

        (folder / "bee.jpg").write_bytes(encode(np.random.default_rng(0).integers(0, 255, (90, 120, 3), "uint8"), "JPEG"))
    return folder / "bee.jpg"


def _counts(url: str, key: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"X-API-Key": key}).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "vitflow_serve_auth_failures" for s in f.samples if s.name.endswith("_total")}


def test_api_keys_guard_the_api_reload_on_sighup_under_load_and_limit_failures(tiny_run, tmp_path, photo):
    run, _ = tiny_run
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# the team's keys\n{KEY_A}\n\n{KEY_B}\n")
    s = Served(run, "--backend", "eager_fp32", "--threads", "1", "--api-key-file", str(keys), log=tmp_path / "log")
    try:
        body = photo.read_bytes()

        def classify(key: str | None = KEY_A, header: str = "Authorization") -> httpx.Response:
            value = key if header == "X-API-Key" or key is None else f"Bearer {key}"
            return httpx.post(s.url + "/v1/classify", content=body, timeout=30,
                              headers={"content-type": "image/jpeg", **({header: value} if key else {})})

        assert httpx.get(s.url + "/healthz").status_code == 200 and httpx.get(s.url + "/readyz").status_code == 200
        page = httpx.get(s.url + "/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        refused = classify(None)
        assert refused.status_code == 401 and refused.json()["kind"] == "unauthorized"
        assert refused.headers["www-authenticate"] == "Bearer" and "X-API-Key" in refused.json()["error"]
        assert classify(KEY_A).status_code == 200 and classify(KEY_B, "X-API-Key").status_code == 200
        schemeless = httpx.post(s.url + "/v1/classify", content=body, headers={"Authorization": KEY_A})
        assert schemeless.status_code == 401 and "without the Bearer scheme" in schemeless.json()["error"]
        assert httpx.get(s.url + "/metrics").status_code == 401 and httpx.get(s.url + "/v1/model").status_code == 401
        card = httpx.get(s.url + "/v1/model", headers={"X-API-Key": KEY_A}).json()
        assert card["class_names"] == Predictor.load(str(run)).classes and card["image_size"] > 0

        with Clients(4, lambda: classify(KEY_A)) as load:  # SIGHUP under load: B out, C in, A kept
            time.sleep(1.0)
            keys.write_text(f"{KEY_A}\n{KEY_C}\n")
            s.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: classify(KEY_C).status_code == 200, 30)
            time.sleep(1.0)
        assert classify(KEY_B).status_code == 401
        statuses = [status for _, status in load.outcomes]
        assert len(statuses) > 8 and set(statuses) == {200}, statuses  # no request dropped, refused or lost
        assert s.proc.poll() is None and "API keys reloaded: 2 key(s)" in s.log.read_text()
        assert re.search(r"POST /v1/classify 401 \S+ ms 127\.0\.0\.1 unauthorized", s.log.read_text())  # its kind

        before = _counts(s.url, KEY_A)
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))  # another address
        answers = [other.post(s.url + "/v1/classify", content=body, headers={"Authorization": "Bearer wrong-key-0123456"})
                   for _ in range(100)]  # a wrong key, 100 times
        codes = [a.status_code for a in answers]
        assert codes == [401] * FAILURES + [429] * (100 - FAILURES), codes
        assert int(answers[-1].headers["retry-after"]) > 0 and answers[-1].json()["kind"] == "rate_limited"
        assert classify(KEY_A).status_code == 200  # the limit is per address: this one's key still works
        after = _counts(s.url, KEY_A)
        assert after["wrong"] - before.get("wrong", 0) == FAILURES
        assert after["limited"] - before.get("limited", 0) == 100 - FAILURES and after["missing"] >= 1
    finally:
        assert s.stop() == 0, s.log.read_text()


def test_tls_is_answered_to_a_client_that_checks_the_certificate(tiny_run, tmp_path, photo):
    run, _ = tiny_run
    pem = self_signed_cert(tmp_path)
    s = Served(run, "--backend", "eager_fp32", "--threads", "1", "--tls-cert", str(pem), "--tls-key", str(pem),
               log=tmp_path / "log", verify=pem)
    try:
        answer = httpx.post(s.url + "/v1/classify", content=photo.read_bytes(), verify=s.verify,
                            headers={"content-type": "image/jpeg"})
        assert answer.status_code == 200 and answer.json()["predictions"][0]["top"]
        with pytest.raises(httpx.ConnectError):  # the system's trust store does not know the certificate
            httpx.get(s.url + "/healthz")
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP on the TLS port
            httpx.get(s.url.replace("https", "http") + "/healthz")
        assert f"https://127.0.0.1:{s.port}" in s.log.read_text()
    finally:
        assert s.stop() == 0, s.log.read_text()


def test_a_certificate_and_key_that_do_not_fit_stop_the_start_in_one_line(tmp_path):
    pem = self_signed_cert(tmp_path)
    check_tls(ServeSettings(source="m", tls_cert=str(pem)))  # one file holding both: fine
    (tmp_path / "other").mkdir()
    other = self_signed_cert(tmp_path / "other")  # another certificate's key
    key_only = tmp_path / "other-key.pem"
    key_only.write_text(other.read_text().split("-----BEGIN CERTIFICATE-----")[0])
    with pytest.raises(ValueError, match="not a PEM certificate and its own private key"):
        check_tls(ServeSettings(source="m", tls_cert=str(pem), tls_key=str(key_only)))
    out = subprocess.run([sys.executable, "-m", "vitflow", "serve", "no-model", "--tls-cert", str(pem), "--tls-key",
                          str(key_only)], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "own private key" in out.stderr


def test_key_files_and_exposure_are_said_in_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("# no key yet\n\n")
    with pytest.raises(KeyFileError, match=f"--api-key-file {empty}: no key in it"):
        read_keys(str(empty))
    short = tmp_path / "short.txt"
    short.write_text(f"{KEY_A}\nhunter2\n")
    with pytest.raises(KeyFileError, match=f"--api-key-file {short} line 2: a key of 7 characters") as e:
        read_keys(str(short))
    assert "hunter2" not in str(e.value)
    with pytest.raises(KeyFileError, match="VITFLOW_SERVE_API_KEYS key 2"):
        read_keys(None, f"{KEY_A},short")
    assert len(read_keys(None, f"{KEY_A}, {KEY_B}")) == 2

    assert access(ServeSettings(source="m", host="0.0.0.0")) == 0
    assert "--host 0.0.0.0 without --api-key-file" in capsys.readouterr().err
    assert access(ServeSettings(source="m", host="127.0.0.1")) == 0 and capsys.readouterr().err == ""
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_A + "\n")
    assert access(ServeSettings(source="m", host="0.0.0.0", api_key_file=str(keys))) == 1
    assert capsys.readouterr().err == ""

    out = subprocess.run([sys.executable, "-m", "vitflow", "serve", "no-model", "--api-key-file", str(empty)],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "no key in it" in out.stderr


def test_the_failure_limit_slides_and_forgets():
    now = [0.0]
    limit = FailureLimit(limit=3, window=10.0, clock=lambda: now[0])
    for _ in range(3):
        assert limit.retry_after("a") == 0
        limit.record("a")
        now[0] += 1
    assert limit.retry_after("a") == pytest.approx(7.0) and limit.retry_after("b") == 0
    now[0] = 10.5  # the first failure left the window
    assert limit.retry_after("a") == 0


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_from_the_services_own_schema(tiny_run, tmp_path):
    pytest.importorskip("schemathesis")
    run, _ = tiny_run
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_A + "\n")
    s = Served(run, "--backend", "eager_fp32", "--threads", "1", "--api-key-file", str(keys), "--max-images", "4",
               "--auth-failures", "0", log=tmp_path / "log")  # the fuzzer's invalid keys: 401 every time
    try:
        start_rss = s.rss_kib()
        report = tmp_path / "junit.xml"
        # every check but "schema-valid data is accepted": no schema can say "a decodable image", and a fuzzed
        # base64 string or body that is not one is rightly answered 400
        cmd = [str(Path(sys.executable).with_name("schemathesis")), "run", s.url + "/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance",
               "-H", f"Authorization: Bearer {KEY_A}", "--max-examples", "40", "--seed", "1",
               "--report", "junit", "--report-junit-path", str(report), "--request-timeout", "30",
               "--no-color"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900, cwd=tmp_path)  # (its files)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-4000:]
        generated = int(re.search(r"(\d+) generated", text).group(1))
        assert generated >= 200, text[-2000:]  # every check held on each (not_a_server_error among them)
        served = httpx.get(s.url + "/metrics", headers={"X-API-Key": KEY_A}).text
        statuses = {smp.labels["status"] for f in text_string_to_metric_families(served)
                    if f.name == "vitflow_serve_requests" for smp in f.samples if smp.name.endswith("_total")}
        assert statuses and not any(code.startswith("5") for code in statuses), statuses
        assert s.proc.poll() is None and s.rss_kib() < start_rss * 1.10 + 20_000, (start_rss, s.rss_kib())  # KiB
        assert "Traceback" not in s.log.read_text()
    finally:
        assert s.stop() == 0, s.log.read_text()


@pytest.mark.slow
def test_attention_route_matches_vitflow_attention_over_the_eval_crop(tiny_run, tmp_path, photo):
    """/v1/attention answers the rollout ``vitflow attention`` draws (same numbers), the class
    ``predict`` gives, and the box of the upload the maps lie over: the centered square the eval
    crop keeps, computed here from the checkpoint's preprocessing."""
    from vitflow.data.decode import decode_image
    from vitflow.viz import attention_maps

    run, _ = tiny_run
    s = Served(run, "--backend", "eager_fp32", "--threads", "1", log=tmp_path / "log")
    try:
        data = photo.read_bytes()
        r = httpx.post(s.url + "/v1/attention", content=data, headers={"Content-Type": "image/jpeg"}, timeout=60)
        card = httpx.get(s.url + "/v1/model").json()
        two = httpx.post(s.url + "/v1/attention", json={"images": [base64.b64encode(data).decode()] * 2}, timeout=60)
    finally:
        assert s.stop() == 0, s.log.read_text()
    assert r.status_code == 200, r.text
    body = r.json()
    predictor = Predictor.from_checkpoint(run, device="cpu", precision="fp32")
    image = decode_image(data, photo.name)
    want = attention_maps(predictor, predictor.transform(image))
    assert body["grid"] == want["grid"] and body["class"] == want["class"] and card["attention"] is True
    assert abs(body["prob"] - want["prob"]) < 1e-5
    assert torch.allclose(torch.tensor(body["rollout"]), want["rollout"], atol=1e-4)
    assert torch.tensor(body["rollout"]).max().item() == 1.0
    h, w = image.shape[-2:]
    pp = predictor.pp
    side = min(w, h) * pp.image_size / round(pp.image_size / pp.crop_pct)
    assert body["view"] == pytest.approx([(w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2], abs=0.01)
    assert card["crop_pct"] == pp.crop_pct
    assert (two.status_code, two.json()["kind"]) == (400, "one_image")


def test_the_page_in_headless_chromium_reads_the_same_top1_as_predict(tiny_run, tmp_path, photo):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver_bin):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    run, _ = tiny_run
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_A + "\n")
    s = Served(run, "--backend", "eager_fp32", "--threads", "1", "--api-key-file", str(keys), log=tmp_path / "log")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_bin), options=options)
    try:
        driver.get(s.url + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "unauthorized" in d.find_element(By.ID, "card").text.lower()
                   or "API key" in d.find_element(By.ID, "card").text)  # the card asks for the key
        box = driver.find_element(By.ID, "key")
        box.send_keys(KEY_A)
        driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", box)
        wait.until(lambda d: "classes" in d.find_element(By.ID, "card").text)
        driver.find_element(By.ID, "files").send_keys(str(photo))
        result = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".result[data-top1]"))[0]
        shown = result.get_attribute("data-top1")
        first_row = result.find_element(By.CSS_SELECTOR, ".row .name").text
        expected = next(Predictor.load(str(run)).predict_refs(collect_images([photo])))["top"][0]["class"]
        assert shown == first_row == expected
        assert "ms in the service" in result.text
        # the attention map drawn over the photo: the rollout's grid, and a canvas that is not blank
        result = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".result[data-attention]"))[0]
        canvas = result.find_element(By.CSS_SELECTOR, "figure.attention canvas")
        assert canvas.get_attribute("data-grid") == "4x4"  # 8 px digits, patch 2
        spread = driver.execute_script("""const d = arguments[0].getContext('2d').getImageData(0, 0, 160, 160).data;
            let lo = 255, hi = 0; for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }
            return hi - lo;""", canvas)
        assert spread > 40  # photo and heat drawn, not an empty canvas
        assert result.get_attribute("data-attention") == expected
        driver.save_screenshot(str(tmp_path / "page.png"))
        assert (tmp_path / "page.png").stat().st_size > 10_000
    finally:
        driver.quit()
        assert s.stop() == 0, s.log.read_text()


def test_the_schema_lists_each_status_and_the_key_schemes(tiny_run, tmp_path):
    run, _ = tiny_run
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_A + "\n")
    s = Served(run, "--backend", "eager_fp32", "--threads", "1", "--api-key-file", str(keys), log=tmp_path / "log")
    try:
        schema = httpx.get(s.url + "/openapi.json").json()
    finally:
        assert s.stop() == 0
    assert set(schema["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    classify = schema["paths"]["/v1/classify"]["post"]
    assert {"200", "400", "401", "408", "413", "415", "429", "503", "504"} <= set(classify["responses"])
    assert classify["security"] == [{"bearer": []}, {"apiKey": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]
    assert json.dumps(schema).count('"error"') >= 8
