"""Chat image content parts through the server (tiny LLaVA, driven by the openai client): answers equal
``PagedEngine.generate`` on the same processed prompt; bad base64, a non-image, a huge image, a remote or local URL
that is not allowed, too many images get 400 and the server stays healthy; local files under the allowed folder."""

from __future__ import annotations

import base64
import io

import pytest
import torch

uvicorn = pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")
httpx = pytest.importorskip("httpx")

from paged_hf import PagedEngine, SamplingParams  # noqa: E402
from paged_hf.media import MediaPolicy  # noqa: E402
from paged_hf.server.app import build_app  # noqa: E402
from test_server import Server  # noqa: E402
from vision_models import llava_processor, random_image, tiny_llava  # noqa: E402

MAX_TOKENS = 5


def data_url(image, kind: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    random_image(7).save(folder / "cat.png")
    processor = llava_processor()
    engine = PagedEngine(tiny_llava(), processor.tokenizer, enforce_eager=True, block_size=4, num_blocks=256,
                         limit_mm_per_prompt={"image": 2})
    running = Server(build_app(engine, "llava", processor=processor,
                               media=MediaPolicy(allowed_local_media_path=str(folder), max_image_pixels=64 * 64)))
    yield running, engine, processor, folder
    running.stop()


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def user(*parts):
    return [{"role": "user", "content": [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": p[0]}}
        for p in parts]}]


def expected(served, text: str, images: list) -> list[int]:
    """The engine's greedy tokens for ``text`` and ``images`` through the processor (the server's path, by hand)."""
    _, engine, processor, _ = served
    inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    return inputs["input_ids"][0].tolist(), {"pixel_values": inputs["pixel_values"]}


def test_image_parts_answer_as_the_engine(served, client):
    first, second = random_image(1), random_image(2, (30, 18))
    answer = client.chat.completions.create(
        model="llava", messages=user("Look ", (data_url(first),), " and ", (data_url(second, "JPEG"),)),
        max_tokens=MAX_TOKENS, temperature=0)
    ids, images = expected(served, "user: Look <image> and <image>assistant:", [first, _jpeg_roundtrip(second)])
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == _engine_text(served, ids, images)
    served[1].check_invariants()
    # /tokenize counts what the chat request ran: every image's tokens (as vLLM's), and refuses an unreadable image
    messages = user("Look ", (data_url(first),), " and ", (data_url(second, "JPEG"),))
    tokenized = httpx.post(served[0].url + "/tokenize", json={"messages": messages}, timeout=60).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == answer.usage.prompt_tokens
    corrupt = httpx.post(served[0].url + "/tokenize", json={"messages": user("Look ", ("data:image/png;base64,@@",))},
                         timeout=60)
    assert corrupt.status_code == 400 and corrupt.json()["error"]["param"] == "messages"


def _jpeg_roundtrip(image):
    from PIL import Image

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def _engine_text(served, ids, images) -> str:
    """The greedy text of a fresh engine over the same model (the served one idles on its own thread)."""
    _, engine, processor, _ = served
    fresh = PagedEngine(engine.model, processor.tokenizer, enforce_eager=True, block_size=4, num_blocks=64)
    out = fresh.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False,
                         images=[images])[0]
    assert len(set(out.outputs[0].token_ids)) > 1, "a degenerate answer would not tell images apart"
    return out.outputs[0].text


def test_a_local_file_under_the_allowed_folder(served, client):
    folder = served[3]
    answer = client.chat.completions.create(model="llava", messages=user("See ", (f"file://{folder}/cat.png",)),
                                            max_tokens=MAX_TOKENS, temperature=0)
    from PIL import Image

    ids, images = expected(served, "user: See <image>assistant:", [Image.open(folder / "cat.png").convert("RGB")])
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == _engine_text(served, ids, images)


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@", "base64 does not decode"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a but not really").decode(), "could not be decoded"),
    ("data:application/pdf;base64,JVBERi0=", "media type must be image"),
    ("huge", "at most 4096 pixels"),
    ("https://example.com/cat.png", "remote image URLs are not allowed"),
    ("file:///etc/passwd", "outside --allowed-local-media-path"),
    ("ftp://example.com/cat.png", "must be data:, http(s): or file:"),
    ("three", "at most 2 are allowed"),
    ("detail", "detail"),
])
def test_bad_images_get_400_and_the_server_stays_healthy(served, client, url, message):
    parts = [(url,)]
    if url == "huge":
        parts = [(data_url(random_image(3, (80, 60))),)]
    elif url == "three":
        parts = [(data_url(random_image(i)),) for i in range(3)]
    messages = user("Look ", *parts)
    if url == "detail":
        messages[0]["content"][1]["image_url"] = {"url": data_url(random_image(1)), "detail": "medium"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llava", messages=messages, max_tokens=MAX_TOKENS)
    assert message in str(info.value)
    assert httpx.get(served[0].url + "/health").status_code == 200
    ok = client.chat.completions.create(model="llava", messages=user("Look ", (data_url(random_image(1)),)),
                                        max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    served[1].check_invariants()


@pytest.mark.parametrize("detail", ["low", "high"])
def test_image_detail_is_honoured(served, client, detail):
    """OpenAI's ``detail``: "low" answers as the engine on the image scaled to fit 512 pixels a side, "high" as on
    the image itself (a 1030x3 image: its low-detail pixels differ)."""
    from paged_hf.multimodal_prompts import low_detail

    image = random_image(8, (1030, 3))
    messages = user("Look ", (data_url(image),))
    messages[0]["content"][1]["image_url"]["detail"] = detail
    answer = client.chat.completions.create(model="llava", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    seen = low_detail(image) if detail == "low" else image
    ids, images = expected(served, "user: Look <image>assistant:", [seen])
    _, other = expected(served, "user: Look <image>assistant:", [image if detail == "low" else low_detail(image)])
    assert not torch.equal(images["pixel_values"], other["pixel_values"])
    assert answer.choices[0].message.content == _engine_text(served, ids, images)


def test_image_parts_on_a_server_without_a_processor(served):
    _, engine, processor, _ = served
    from test_server import Server as Plain

    running = Plain(build_app(PagedEngine(engine.model, processor.tokenizer, enforce_eager=True, block_size=4,
                                          num_blocks=64), "llava"))
    try:
        reply = httpx.post(running.url + "/v1/chat/completions", json={
            "model": "llava", "messages": user("Look ", (data_url(random_image(1)),)), "max_tokens": 2})
        assert reply.status_code == 400 and "no processor" in reply.text
    finally:
        running.stop()
        engine.model.set_attn_implementation("paged")


def test_paged_hf_serve_loads_a_vision_model_folder_with_its_media_flags(tmp_path):
    """The command line end to end: a saved tiny LLaVA and its processor, served with an allowed local folder and a
    one-image limit."""
    from served import Served

    folder = tmp_path / "llava"
    tiny_llava().save_pretrained(folder)
    llava_processor().save_pretrained(folder)
    media = tmp_path / "media"
    media.mkdir()
    random_image(7).save(media / "cat.png")
    server = Served(folder, "--enforce-eager", "--block-size", "4", "--num-blocks", "64",
                    "--allowed-local-media-path", str(media), "--limit-mm-per-prompt", '{"image": 1}',
                    log_dir=tmp_path)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="llava", messages=user("See ", (f"file://{media}/cat.png",)),
                                                max_tokens=3, temperature=0)
        assert answer.usage.prompt_tokens == len(llava_processor()(
            text=["user: See <image>assistant:"], images=[random_image(7)], add_special_tokens=False)["input_ids"][0])
        with pytest.raises(openai.BadRequestError, match="at most 1 are allowed"):
            client.chat.completions.create(model="llava", max_tokens=3,
                                           messages=user((data_url(random_image(1)),), (data_url(random_image(2)),)))
    finally:
        server.stop()


def test_the_image_flags_reach_the_app_and_the_engine(monkeypatch):
    import types

    import uvicorn as uvicorn_module

    from paged_hf import cli
    from paged_hf.server import app as app_module

    seen = {}
    monkeypatch.setattr(cli, "_load_engine", lambda args, source: (
        types.SimpleNamespace(model=None, options=seen.setdefault("engine", cli._engine_options(args))), "model"))
    monkeypatch.setattr(app_module, "build_app", lambda engine, name, *limits, **options: seen.update(options))
    monkeypatch.setattr(uvicorn_module, "run", lambda app, **kwargs: None)
    assert cli.main(["serve", "--allowed-media-domains", "Example.com", "cdn.example.org", "--max-image-pixels", "100",
                     "--limit-mm-per-prompt", '{"image": 2}', "--max-num-encoder-input-tokens", "64"]) == 0
    assert seen["media"] == MediaPolicy(("example.com", "cdn.example.org"), None, 100)
    assert seen["engine"]["limit_mm_per_prompt"] == {"image": 2}
    assert seen["engine"]["max_num_encoder_input_tokens"] == 64
    with pytest.raises(SystemExit):
        cli.main(["serve", "--limit-mm-per-prompt", "2"])


# ------------------------------------------------------------------------------------------------ properties
from hypothesis import given, settings, strategies as st  # noqa: E402

from paged_hf.config import ParameterError  # noqa: E402
from paged_hf.media import load_image  # noqa: E402


@settings(max_examples=80, deadline=None)
@given(payload=st.one_of(st.binary(max_size=64), st.sampled_from(["PNG", "JPEG", "GIF", "BMP"])),
       media_type=st.sampled_from(["image/png", "image/jpeg", "", "text/plain", "image/x-nothing"]),
       mangle=st.sampled_from(["none", "no-base64-marker", "bad-padding", "spaces"]),
       size=st.tuples(st.integers(1, 90), st.integers(1, 90)))
def test_any_data_url_is_an_rgb_image_within_the_limit_or_a_parameter_error(payload, media_type, mangle, size):
    """Whatever a data URL holds, load_image returns an RGB image no larger than max_image_pixels or raises
    ParameterError naming the field: never another exception."""
    if isinstance(payload, str):  # a real image of that format
        buffer = io.BytesIO()
        random_image(1, size).save(buffer, format=payload)
        payload = buffer.getvalue()
    encoded = base64.b64encode(payload).decode()
    url = {"none": f"data:{media_type};base64,{encoded}", "no-base64-marker": f"data:{media_type},{encoded}",
           "bad-padding": f"data:{media_type};base64,{encoded}=", "spaces": f"data:{media_type};base64, {encoded}"}[mangle]
    policy = MediaPolicy(max_image_pixels=64 * 64)
    try:
        image = load_image(url, policy, "messages")
    except ParameterError as error:
        assert error.param == "messages"
        return
    assert image.mode == "RGB" and image.size[0] * image.size[1] <= 64 * 64


def test_a_photo_is_turned_upright_by_its_exif_orientation():
    """A 40x20 JPEG whose EXIF says "rotate 90°" (a phone photo) is 20x40 to the model, as transformers' and vLLM's
    loaders give it."""
    from PIL import Image

    from paged_hf.media import load_image

    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW
    buffer = io.BytesIO()
    Image.new("RGB", (40, 20), (200, 10, 10)).save(buffer, format="JPEG", exif=exif)
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert load_image(url).size == (20, 40)


def test_remote_images_follow_redirects_only_to_allowed_hosts():
    """``--allowed-media-domains`` bounds every hop: a redirect to another host is refused by name."""
    import http.server
    import threading

    from paged_hf.config import ParameterError
    from paged_hf.media import load_image

    png = io.BytesIO()
    random_image(8, (8, 8)).save(png, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/image.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(png.getvalue())
            else:  # /elsewhere: the same image under another host name
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/image.png")
                self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        only_ip = MediaPolicy(allowed_media_domains=["127.0.0.1"])
        assert load_image(base + "/image.png", only_ip).size == (8, 8)
        with pytest.raises(ParameterError, match="not allowed for host 'localhost'"):
            load_image(base + "/elsewhere", only_ip)
        both = MediaPolicy(allowed_media_domains=["127.0.0.1", "localhost"])
        assert load_image(base + "/elsewhere", both).size == (8, 8)
    finally:
        server.shutdown()
