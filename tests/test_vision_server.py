"""Images end to end: a real ``tidal serve`` on a tiny K3 checkpoint with a tiny vision tower,
driven by the openai and anthropic SDKs and raw HTTP: image requests succeed and count their
image tokens, different images give different logits, the next turn hits the prefix cache past
the image, every bad image is a 400 naming the problem, and a text-only model refuses images."""

from __future__ import annotations

import atexit
import base64
import io
import json

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch
from live_server import MODEL, Server, start_server
from PIL import Image

from tidal import presets
from tidal.config import ModelConfig
from tidal.embedded import write_byte_tokenizer
from tidal.model.checkpoint import save_model
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.tokenizer import load_tokenizer


def write_checkpoint(out) -> None:
    n_tokens, ids = write_byte_tokenizer(out)
    vocab = (n_tokens + 63) // 64 * 64
    d = presets.tiny_k3_dict(vocab_size=vocab, vision=True, mxfp4=False)
    d.update(bos_token_id=ids["[BOS]"], eos_token_id=ids["<|end_of_msg|>"], pad_token_id=ids["[PAD]"],
             media_placeholder_token_id=ids["<|media_pad|>"])
    d["text_config"]["eos_token_id"] = ids["<|end_of_msg|>"]
    torch.manual_seed(0)
    model = init_weights(KimiForCausalLM(ModelConfig.from_dict(d)), seed=1)
    save_model(model, out, dtype=torch.float32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision-ckpt")
    write_checkpoint(out)
    return out


@pytest.fixture(scope="module")
def pad_id(ckpt) -> int:
    return load_tokenizer(ckpt).special_tokens["<|media_pad|>"]


@pytest.fixture(scope="module")
def vision_server(ckpt) -> Server:
    server = start_server(str(ckpt), "--max-image-pixels", "200000", "--limit-mm-per-prompt", '{"image": 2}')
    atexit.register(server.stop)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(vision_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vision_server.url}/v1", api_key="none", max_retries=0, timeout=120)


def png(seed: int, w: int = 60, h: int = 45, fmt: str = "PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def user(url: str, text: str = "What is in the picture?") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 4),
                                          temperature=0, **kw)


def tokenize(server, messages) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_image_request_counts_image_tokens(vision_server, oai, pad_id):
    msgs = [user(data_url(png(1)))]
    ids = tokenize(vision_server, msgs)
    text_only = tokenize(vision_server, [{"role": "user", "content": "What is in the picture?"}])
    # 60x45 -> padded 84x56 -> 6x4 patches -> 6 merged tokens, plus begin "image 60x45" content ... end
    assert ids.count(pad_id) == 6
    assert len(ids) == len(text_only) + 6 + 2 + len("image 60x45") + 1
    r = chat(oai, msgs)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(ids)


def test_different_images_give_different_logits(oai):
    def top(seed):
        r = chat(oai, [user(data_url(png(seed)))], max_tokens=1, logprobs=True, top_logprobs=5)
        return [(t.token, round(t.logprob, 5)) for t in r.choices[0].logprobs.content[0].top_logprobs]

    a, b = top(1), top(2)
    assert a == top(1)
    assert a != b


def test_next_turn_hits_the_prefix_cache_past_the_image(vision_server, oai, pad_id):
    img = data_url(png(7, 90, 70))
    first = [user(img, "Describe it.")]
    ids = tokenize(vision_server, first)
    image_end = max(i for i, t in enumerate(ids) if t == pad_id) + 1
    r1 = chat(oai, first)
    follow = first + [{"role": "assistant", "content": r1.choices[0].message.content or ""},
                      {"role": "user", "content": "And the colours?"}]
    r2 = chat(oai, follow)
    assert r2.usage.prompt_tokens_details.cached_tokens > image_end
    # the same conversation with another image at the same place: no hit past its first pad
    other = [user(data_url(png(8, 90, 70)), "Describe it.")] + follow[1:]
    r3 = chat(oai, other)
    assert r3.usage.prompt_tokens_details.cached_tokens < image_end - 1


def test_anthropic_image_block(vision_server):
    client = anthropic.Anthropic(base_url=vision_server.url, api_key="none", max_retries=0, timeout=120)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(3)).decode()}}
    r = client.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "Describe it."}]}])
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.input_tokens > 6
    count = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "Describe it."}]}])
    assert count.input_tokens == r.usage.input_tokens


def post_chat(server, content, path="/v1/chat/completions"):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


BAD_CASES = [
    ([image_part(data_url(b"definitely not an image"))], "not an image in a supported format"),
    ([image_part(data_url(png(1)[:200]))], "corrupt or truncated"),
    ([image_part(data_url(png(1, 20, 20, "TIFF"), "image/tiff"))], "image format TIFF is not supported"),
    ([image_part(data_url(png(1, 500, 500)))], "500x500 = 250000 pixels, more than the limit of 200000"),
    ([image_part(data_url(png(i))) for i in range(3)], "3 images, more than the limit of 2 \\(--limit-mm-per-prompt\\)"),
    ([image_part("data:image/png;base64,@@@notbase64")], "base64 is invalid"),
    ([image_part("data:image/png;base64,")], "the image data is empty"),
    ([image_part("http://127.0.0.1:9/cat.png")], "fetching image URLs is disabled on this server"),
    ([image_part("ftp://example.com/cat.png")], "scheme 'ftp' is not supported"),
]


@pytest.mark.parametrize("content, message", BAD_CASES)
def test_bad_images_are_400s_naming_the_problem(vision_server, content, message):
    r = post_chat(vision_server, content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert __import__("re").search(message, err["message"]), err
    assert httpx.get(f"{vision_server.url}/health").status_code == 200


def test_anthropic_bad_image_is_a_400(vision_server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"xx").decode()}}]}]}
    r = httpx.post(f"{vision_server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and "not an image" in json.dumps(r.json())
    body["messages"][0]["content"][0]["source"] = {"type": "file", "file_id": "f"}
    r = httpx.post(f"{vision_server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and "image source type 'file' is not supported" in json.dumps(r.json())


def test_text_only_model_refuses_images():
    from test_server import API_KEY, shared_server

    server = shared_server()
    body = {"model": MODEL, "max_tokens": 2, "messages": [user(data_url(png(1)))]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=60)
    assert r.status_code == 400 and "this model takes no images" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY}, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(1)).decode()}}]}]})
    assert r.status_code == 400 and "this model takes no images" in json.dumps(r.json())
