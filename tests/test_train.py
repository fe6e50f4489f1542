"""Training: differentiable kernels, the trainable model == the inference model, QAT, data,
tokenizer, the 20-step smoke run, resume == uninterrupted run, quantize, and the eval metrics."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tidal import presets
from tidal.model.checkpoint import K3_FP32_ON_DISK, load_model
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.ops.kda import kda_chunked, kda_recurrent, l2_normalize
from tidal.ops.mxfp import fake_quantize_mxfp4
from tidal.tokenizer import load_tokenizer
from tidal.train import cli as train_cli
from tidal.train import quantize as quantize_cli
from tidal.train.conversations import TOOLS, heldout_tool_prompts, tool_dialogue
from tidal.train.data import HELDOUT_MODULES, Corpus, load_sources, sample_batch, stdlib_files
from tidal.train.evaluate import completion_parses, function_headers, stream_loss, tool_call_check, unigram_loss
from tidal.train.trainable import make_trainable, plain_state_dict, qat_cached
from tidal.train.trainer import TrainConfig, Trainer, lm_loss

SMOKE_ARGS = ["--size", "tiny", "--steps", "20", "--batch-size", "2", "--seq-len", "64", "--vocab-size", "600",
              "--conversations", "60", "--max-modules", "8", "--threads", "1", "--log-every", "5",
              "--eval-every", "10", "--save-every", "10", "--warmup", "5", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The 20-step smoke run of ``tidal train`` (tiny model, tiny data slice), exported."""
    root = tmp_path_factory.mktemp("train")
    run, fp32 = root / "run", root / "fp32"
    assert train_cli.main([*SMOKE_ARGS, "--out", str(run), "--export", str(fp32)]) == 0
    return run, fp32


# ---- kernels and the trainable model ----------------------------------------------------------------


def kda_inputs(B, T, H, K, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype)) * K**-0.5
    k = l2_normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype))
    v = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    gate = -torch.rand(B, T, H, K, generator=g, dtype=dtype) * 2
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def test_kda_chunked_backward_matches_recurrent():
    """Gradients through the chunked kernel (what training uses) equal the token-by-token reference's."""
    inputs = kda_inputs(2, 37, 2, 8)
    state = torch.zeros(2, 2, 8, 8, dtype=torch.float64)
    w = torch.randn(2, 37, 2, 8, dtype=torch.float64)
    grads = []
    for kernel, kw in ((kda_recurrent, {}), (kda_chunked, {"chunk_size": 16})):
        o, _ = kernel(*inputs, state, **kw)
        grads.append(torch.autograd.grad((o * w).sum(), inputs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def tiny_model(seed=0, **kw):
    config = presets.tiny_k3(**kw)
    return init_weights(KimiForCausalLM(config), seed=seed).to_dtype(torch.float64)


def forward_logits(model, seqs):
    cache = SimpleCache(model.config, len(seqs), model.dtype)
    batch = simple_batch(model.config, [len(s) for s in seqs], cache, [0] * len(seqs))
    return model.compute_logits(model(torch.cat(seqs), batch))


@pytest.mark.parametrize("lengths", [[40, 40, 40], [40, 23, 40, 9]])
def test_trainable_model_equals_inference_model(lengths):
    """TrainableKDA (batched zero-state conv + chunked KDA) computes what the inference layers do,
    for equal-length batches (views) and mixed lengths (grouped)."""
    ref = tiny_model(mxfp4=False)
    train = make_trainable(tiny_model(mxfp4=False), qat=False)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    torch.testing.assert_close(forward_logits(train, seqs), forward_logits(ref, seqs), rtol=1e-9, atol=1e-9)


def test_qat_forward_sees_mxfp4_experts_and_gradients_pass_straight_through():
    plain = tiny_model()
    quantized = tiny_model()
    with torch.no_grad():
        for name, p in quantized.named_parameters():
            if ".experts.w" in name:
                p.copy_(fake_quantize_mxfp4(p))
    qat = make_trainable(tiny_model(), qat=True)
    seqs = [torch.randint(0, 256, (30,)) for _ in range(2)]
    with qat_cached():
        got = forward_logits(qat, seqs)
        got.square().mean().backward()
    torch.testing.assert_close(got, forward_logits(quantized, seqs), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got, forward_logits(plain, seqs))
    master = qat.model.layers[1].block_sparse_moe.experts.parametrizations.w1.original
    assert master.grad is not None and master.grad.abs().sum() > 0
    assert set(plain_state_dict(qat)) == set(plain.state_dict())


# ---- data, conversations, tokenizer -----------------------------------------------------------------


def test_stdlib_split_holds_out_the_fixed_modules():
    sources = load_sources()
    assert {m.split(".")[0] for m in sources.heldout} == set(HELDOUT_MODULES)
    assert not any(m.split(".")[0] in HELDOUT_MODULES for m in sources.train)
    assert not any("site-packages" in str(p) or "/test/" in str(p) for p in stdlib_files())


def test_sample_batch_is_a_function_of_seed_and_step():
    corpus = Corpus(torch.arange(1000, dtype=torch.int32), torch.arange(5000, 5600, dtype=torch.int32),
                    torch.tensor([0, 150, 300, 450]), torch.arange(10, dtype=torch.int32))
    a, mask = sample_batch(corpus, 0, 7, 16, 32, 0.5)
    assert torch.equal(a, sample_batch(corpus, 0, 7, 16, 32, 0.5)[0]) and bool(mask.all())
    assert not torch.equal(a, sample_batch(corpus, 0, 8, 16, 32, 0.5)[0])
    chat_rows = a[a[:, 0] >= 5000]
    assert len(chat_rows) and set((chat_rows[:, 0] - 5000).tolist()) <= {0, 150, 300, 450}


def test_tool_dialogue_round_trips_through_the_server_parser():
    """A training dialogue's assistant turn, rendered and parsed back, is a valid call of its tool;
    the metric rejects a wrong tool name and a wrongly typed argument."""
    rng = random.Random(5)
    for _ in range(20):
        conv = tool_dialogue(rng)
        if conv.effort == "off":
            continue
        text = conv.render().text
        reply = text.split('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', 1)[1]
        reply = reply.split("<|end_of_msg|>", 1)[0]
        assert tool_call_check(reply, conv) == (True, True)
        wrong = reply.replace(f'tool="{conv.tool}"', 'tool="no_such_tool"')
        assert tool_call_check(wrong, conv) == (False, False)
    conv = next(c for c in heldout_tool_prompts(random.Random(0), 50) if c.tool == "create_reminder")
    bad = ('x<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
           '<|open|>call tool="create_reminder" index="1"<|sep|><|open|>argument key="text" type="string"<|sep|>'
           'nap<|close|>argument<|sep|><|open|>argument key="minutes" type="string"<|sep|>ten<|close|>argument<|sep|>'
           '<|close|>call<|sep|><|close|>tools<|sep|>')
    assert tool_call_check(bad, conv) == (False, True)
    assert tool_call_check(bad.replace('type="string"<|sep|>ten', 'type="number"<|sep|>10'), conv) == (True, True)


def test_heldout_tool_prompts_use_unseen_values():
    train_text = " ".join(tool_dialogue(random.Random(i)).render().text for i in range(300))
    for conv in heldout_tool_prompts(random.Random(0), 30):
        assert conv.tool in TOOLS and len(conv.messages) == 1
    assert all(TOOLS[c.tool] for c in heldout_tool_prompts(random.Random(0), 5))
    assert "Helsinki" not in train_text and "nadia@" not in train_text


def test_smoke_run_tokenizer(smoke):
    run, fp32 = smoke
    tok = load_tokenizer(fp32)
    for special in ("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"):
        assert special in tok.special_tokens
    code = "def f(x):\n    return x  # <|open|>\n"
    ids = tok.encode(code)
    assert tok.decode(ids) == code and tok.special_tokens["<|open|>"] not in ids
    assert tok.eos_token_id == tok.special_tokens["<|end_of_msg|>"]


# ---- the smoke run, resume, quantize ----------------------------------------------------------------


def test_smoke_run_loss_falls_and_checkpoints(smoke):
    run, fp32 = smoke
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [5, 10, 15, 20]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    assert "heldout_loss" in log[-1]
    state = torch.load(run / "state.pt", weights_only=False)
    assert state["step"] == 20 and state["optimizer"]["state"]
    model = load_model(fp32, torch.float32)
    assert model.config.expert_format == "dense" and model.config.eos_token_ids


def test_resume_equals_uninterrupted_run(smoke, tmp_path):
    run, _ = smoke
    tok = load_tokenizer(run)
    corpus = Corpus.load(run / "corpus.pt")
    config = train_cli.model_config("tiny", tok)
    cfg = TrainConfig(steps=6, batch_size=2, seq_len=32, warmup=2, lr=1e-2, eval_every=0, log_every=100, save_every=100)
    straight = Trainer(config, corpus, cfg, tmp_path / "a")
    straight.run(log=lambda _: None)
    first = Trainer(config, corpus, TrainConfig(**{**cfg.__dict__, "time_limit_s": 0.0}), tmp_path / "b")
    first.run(log=lambda _: None)  # stops before any step, checkpoints step 0
    cut = Trainer(config, corpus, TrainConfig(**{**cfg.__dict__, "stop_at": 3}), tmp_path / "b")
    assert cut.resume() and cut.step == 0
    cut.run(log=lambda _: None)  # --stop-at: steps 0..2, checkpoint at step 3
    assert cut.step == 3
    resumed = Trainer(config, corpus, cfg, tmp_path / "b")
    assert resumed.resume() and resumed.step == 3
    resumed.run(log=lambda _: None)
    a, b = plain_state_dict(straight.model), plain_state_dict(resumed.model)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_init_from_a_checkpoint_starts_from_its_weights(smoke, tmp_path):
    """--init: the fine-tune's master weights are the checkpoint's (MXFP4 experts dequantised
    exactly), and its first steps train them."""
    run, fp32 = smoke
    assert quantize_cli.main([str(fp32), str(tmp_path / "q")]) == 0
    tok = load_tokenizer(run)
    corpus = Corpus.load(run / "corpus.pt")
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=32, warmup=1, lr=1e-3, eval_every=0, log_every=100, save_every=100)
    trainer = Trainer(train_cli.model_config("tiny", tok), corpus, cfg, tmp_path / "ft")
    trainer.init_from(tmp_path / "q")
    want = load_model(tmp_path / "q", torch.float32).state_dict()
    got = plain_state_dict(trainer.model)
    for k in want:
        torch.testing.assert_close(got[k], want[k].float(), rtol=0, atol=0)
    trainer.run(log=lambda _: None)
    assert not torch.equal(plain_state_dict(trainer.model)["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


def test_export_blends_with_a_checkpoint(smoke, tmp_path):
    """--blend-with: the exported weights are weight * trained + (1 - weight) * the other checkpoint's."""
    run, fp32 = smoke
    tok = load_tokenizer(run)
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=32, warmup=1, lr=1e-2, eval_every=0, log_every=100, save_every=100)
    trainer = Trainer(train_cli.model_config("tiny", tok), Corpus.load(run / "corpus.pt"), cfg, tmp_path / "ft")
    trainer.run(log=lambda _: None)
    mine, theirs = plain_state_dict(trainer.model), load_model(fp32, torch.float32).state_dict()
    train_cli.export(trainer, run, tmp_path / "blend", str(fp32), 0.25)
    got = load_model(tmp_path / "blend", torch.float32).state_dict()
    for k in theirs:
        if theirs[k].is_floating_point():
            torch.testing.assert_close(got[k], 0.25 * mine[k] + 0.75 * theirs[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(got["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])


def test_quantize_writes_exact_mxfp4_experts(smoke, tmp_path):
    _, fp32 = smoke
    assert quantize_cli.main([str(fp32), str(tmp_path / "q")]) == 0
    src, q = load_model(fp32, torch.float32), load_model(tmp_path / "q", torch.float32)
    assert q.config.expert_format == "mxfp4-pack-quantized"
    assert (tmp_path / "q" / "tokenizer.json").exists()
    s, t = src.state_dict(), q.state_dict()
    for k in s:
        if ".experts.w" in k:
            want = fake_quantize_mxfp4(s[k])
        elif any(k.endswith(name) for name in K3_FP32_ON_DISK):
            want = s[k]
        else:
            want = s[k].to(torch.bfloat16).float()
        torch.testing.assert_close(t[k], want, rtol=0, atol=0)
    assert quantize_cli.main([str(fp32), str(fp32)]) == 2


# ---- evaluation metrics -----------------------------------------------------------------------------


def test_completion_parses():
    h = "def f(x):"
    assert completion_parses(h, "\n    y = x + 1\n    return y\n\ndef g():", ended=False)
    assert completion_parses(h, "\n    return x\n    y = (1,", ended=False)  # cut line dropped
    assert not completion_parses(h, "\n    return x +\n\nclass A:", ended=False)
    assert not completion_parses(h, "\n\n", ended=True)
    assert not completion_parses(h, " return x", ended=True)


def test_function_headers_are_headers():
    sources = {k: v for k, v in load_sources().heldout.items() if k == "textwrap"}
    headers = function_headers(sources, 10)
    assert headers and all(h.lstrip().startswith(("def ", "async def ")) and h.endswith(":") for h in headers)


def test_stream_loss_and_unigram(smoke):
    run, fp32 = smoke
    corpus = Corpus.load(run / "corpus.pt")
    model = load_model(fp32, torch.float32)
    stream = corpus.heldout[:300]
    loss, n = stream_loss(model, stream, seq_len=64)
    assert n == 299
    windows = [stream[s : s + 65] for s in range(0, 299, 64)]
    with torch.no_grad():
        direct = sum(float(lm_loss(model, w[None].long())) * (len(w) - 1) for w in windows) / 299
    assert loss == pytest.approx(direct, rel=1e-5)
    counts = corpus.token_counts(model.config.vocab_size)
    p = (counts.double() + 1) / (counts.sum() + len(counts))
    assert unigram_loss(counts, stream) == pytest.approx(float(-p[stream[1:].long()].log().mean()))
