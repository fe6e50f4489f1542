"""The MoonViT tower + projector: K2.5 settings against transformers' Kimi_K25 classes on weights
transformers saved (read by tidal from the original checkpoint names), K3 settings against a
float64 reference written here from vision.md; config and checkpoint errors."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tidal import presets
from tidal.config import ConfigError, ModelConfig
from tidal.model.checkpoint import CheckpointError, load_model, save_model
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.model.vision import KimiVisionModel, parse_vision_config

GRIDS = [(8, 8), (4, 6), (10, 2), (2, 14), (6, 12)]  # patch grids; (8, 8) is the table's own size


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def random_patches(h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(h * w, 3, 14, 14, generator=g) * 2 - 1


# ---- K2.5 settings == transformers ---------------------------------------------------------------

K25_VISION = {"vt_hidden_size": 32, "vt_intermediate_size": 48, "vt_num_hidden_layers": 2,
              "vt_num_attention_heads": 2, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
              "mm_projector_type": "patchmerger", "mm_hidden_size": 32, "projector_ln_eps": 1e-5,
              "merge_kernel_size": [2, 2], "patch_size": 14}


@pytest.fixture(scope="module")
def transformers_k25(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    text = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, vocab_size=64, n_routed_experts=2,
                num_experts_per_tok=1, moe_intermediate_size=8, kv_lora_rank=8, q_lora_rank=8,
                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, first_k_dense_replace=1)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  patch_size=14, pos_emb_height=8, pos_emb_width=8)
    config = Kimi_K25Config(vision_config=vision, text_config=text, projection_hidden_size=32)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():  # every weight random, norms and biases included
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    out = tmp_path_factory.mktemp("k25")
    model.save_pretrained(out)
    return model, out


def tf_vision_tensors(saved) -> dict[str, torch.Tensor]:
    """The vision tensors transformers wrote, under the original names. Its reverse mapping misses
    two of them (vision.md §2 lists the originals): the patch-embedding conv comes back as
    ``vision_tower.encoder.patch_embed.*`` and the projector's pre_norm keeps its ``model.`` prefix."""
    state = load_file(str(saved / "model.safetensors"))
    out = {}
    for name, t in state.items():
        name = name.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
        name = name.removeprefix("model.")
        if name.startswith(("vision_tower.", "mm_projector.")):
            out[name] = t
    return out


def test_k25_tower_matches_transformers(transformers_k25, tmp_path):
    tf_model, saved = transformers_k25
    vision = tf_vision_tensors(saved)
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in vision  # unsplit, as the original layout
    d = presets.tiny_k3_dict(hidden_size=64, mxfp4=False)
    d["vision_config"] = dict(K25_VISION, text_hidden_size=64)
    text_model = init_weights(KimiForCausalLM(ModelConfig.from_dict(d)))
    save_model(text_model, tmp_path, dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert set(k for k in state if k.startswith(("vision_tower.", "mm_projector."))) == set(vision)
    state.update(vision)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, torch.float32)
    for i, (h, w) in enumerate(GRIDS):
        patches = random_patches(h, w, i)
        with torch.no_grad():
            ref = tf_model.model.get_image_features(patches, torch.tensor([[1, h, w]])).pooler_output[0]
            ours = model.embed_image(patches, (h, w))
        assert ours.shape == (h * w // 4, 64)
        assert rel_err(ours, ref) < 1e-4, (h, w)


def test_k25_several_images_at_once_match_one_by_one(transformers_k25):
    """transformers runs a batch of images with per-image attention: each equals its own run."""
    tf_model, _ = transformers_k25
    grids = [(4, 6), (6, 12)]
    patches = [random_patches(h, w, 10 + i) for i, (h, w) in enumerate(grids)]
    with torch.no_grad():
        both = tf_model.model.get_image_features(torch.cat(patches), torch.tensor([[1, h, w] for h, w in grids]))
        for p, (h, w), ref in zip(patches, grids, both.pooler_output):
            one = tf_model.model.get_image_features(p, torch.tensor([[1, h, w]])).pooler_output[0]
            assert rel_err(one, ref) < 1e-5


# ---- K3 settings == a float64 reference ------------------------------------------------------------

K3_VISION = {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_hidden_layers": 2,
             "vt_num_attention_heads": 2, "qkv_hidden_size": 48, "init_pos_emb_height": 8,
             "init_pos_emb_width": 8, "pos_emb_interpolation_mode": "bilinear", "norm_type": "rmsnorm",
             "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
             "mm_projector_type": "patchmergerv2", "mm_hidden_size": 32, "text_hidden_size": 40,
             "projector_ln_eps": 1e-5}


def bilinear_1d(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] weights of align_corners=False linear resampling (edge samples clamped)."""
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for o in range(n_out):
        src = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(math.floor(src)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        frac = src - i0
        m[o, i0] += 1 - frac
        m[o, i1] += frac
    return m


def reference_k3(sd: dict[str, torch.Tensor], c, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """vision.md §1 with §5's changes, in float64, written token by token where it matters."""
    sd = {k: v.double() for k, v in sd.items()}
    eps = torch.finfo(torch.float32).eps

    def rms(x, wt, e=eps):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + e) * wt

    D, H, hd = c.hidden_size, c.num_attention_heads, c.head_dim
    x = patches.double().reshape(h * w, -1) @ sd["vision_tower.patch_embed.proj.weight"].reshape(D, -1).T
    table = sd["vision_tower.patch_embed.pos_emb.weight"]  # [H0, W0, D]
    pos = torch.einsum("ai,bj,ijd->abd", bilinear_1d(table.shape[0], h), bilinear_1d(table.shape[1], w), table)
    x = x + pos.reshape(h * w, D)
    # complex rotary: pair 2i <- column * f_i, pair 2i+1 <- row * f_i, f_i = 10000^(-4i/hd)
    cis = torch.zeros(h * w, hd // 2, dtype=torch.complex128)
    for r in range(h):
        for col in range(w):
            for i in range(hd // 4):
                f = 10000.0 ** (-4 * i / hd)
                cis[r * w + col, 2 * i] = complex(math.cos(col * f), math.sin(col * f))
                cis[r * w + col, 2 * i + 1] = complex(math.cos(r * f), math.sin(r * f))

    def rope(t):  # [N, H, hd]
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * cis[:, None, :]).reshape(t.shape)

    for b in range(c.num_hidden_layers):
        p = f"vision_tower.encoder.blocks.{b}."
        y = rms(x, sd[p + "norm0.weight"])
        qkv = y @ sd[p + "wqkv.weight"].T
        q, k, v = (qkv[:, j * c.qkv_hidden_size:(j + 1) * c.qkv_hidden_size].reshape(-1, H, hd) for j in range(3))
        q, k = rope(q), rope(k)
        att = torch.softmax(torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(hd), dim=-1)
        o = torch.einsum("hnm,mhd->nhd", att, v).reshape(h * w, -1)
        x = x + o @ sd[p + "wo.weight"].T
        y = rms(x, sd[p + "norm1.weight"])
        x = x + F.gelu(y @ sd[p + "mlp.fc0.weight"].T, approximate="tanh") @ sd[p + "mlp.fc1.weight"].T
    x = rms(x, sd["vision_tower.encoder.final_layernorm.weight"])
    merged = []
    for r in range(0, h, 2):
        for col in range(0, w, 2):
            merged.append(torch.cat([x[r * w + col], x[r * w + col + 1], x[(r + 1) * w + col], x[(r + 1) * w + col + 1]]))
    m = torch.stack(merged)
    m = F.gelu(m @ sd["mm_projector.proj.0.weight"].T) @ sd["mm_projector.proj.2.weight"].T
    return rms(m, sd["mm_projector.post_norm.weight"], c.projector_ln_eps)


def test_k3_tower_matches_float64_reference():
    c = parse_vision_config(K3_VISION, 40)
    torch.manual_seed(1)
    model = KimiVisionModel(c)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    sd = model.state_dict()
    assert "vision_tower.encoder.blocks.0.norm0.bias" not in sd and sd["vision_tower.encoder.blocks.0.wqkv.weight"].shape == (144, 32)
    assert sd["vision_tower.encoder.blocks.0.wo.weight"].shape == (32, 48)
    for i, (h, w) in enumerate(GRIDS):
        patches = random_patches(h, w, 100 + i)
        with torch.no_grad():
            ours = model(patches, (h, w))
        assert rel_err(ours, reference_k3(sd, c, patches, h, w)) < 1e-4, (h, w)


# ---- config -----------------------------------------------------------------------------------------

def test_preset_vision_config_is_k3s():
    c = presets.preset("kimi-k3").vision
    assert (c.hidden_size, c.num_attention_heads, c.qkv_hidden_size, c.head_dim) == (1024, 12, 1536, 128)
    assert (c.norm_type, c.interpolation_mode, c.projector_type, c.attn_bias) == ("rmsnorm", "bilinear", "patchmergerv2", False)
    with torch.device("meta"):
        m = KimiVisionModel(c)
    assert sum(p.numel() for p in m.vision_tower.parameters()) == 401_214_464  # vision.md §5


@pytest.mark.parametrize("change, message", [
    ({"vt_hidden_size": None}, "'vision_config.vt_hidden_size' is missing"),
    ({"vt_num_hidden_layers": None}, "'vision_config.vt_num_hidden_layers' is missing"),
    ({"text_hidden_size": 41}, "'vision_config.text_hidden_size' \\(41\\) contradicts the text model's hidden_size \\(40\\)"),
    ({"mm_hidden_size": 16}, "'vision_config.mm_hidden_size' \\(16\\) and 'vt_hidden_size' \\(32\\) contradict"),
    ({"qkv_hidden_size": 47}, "'vision_config.qkv_hidden_size' \\(47\\) and 'vt_num_attention_heads'"),
    ({"norm_type": "batchnorm"}, "'vision_config.norm_type' is 'batchnorm'"),
    ({"pos_emb_interpolation_mode": "nearest"}, "pos_emb_interpolation_mode' is 'nearest'"),
    ({"norm_type": "layernorm"}, "mm_projector_type' \\(patchmergerv2\\) and 'norm_type' \\(layernorm\\) contradict"),
    ({"attn_bias": "no"}, "'vision_config.attn_bias' has type str"),
])
def test_vision_config_errors_name_the_field(change, message):
    raw = dict(K3_VISION)
    for k, v in change.items():
        if v is None:
            del raw[k]
        else:
            raw[k] = v
    with pytest.raises(ConfigError, match=message):
        parse_vision_config(raw, 40)


def test_unknown_vision_fields_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tidal.config"):
        parse_vision_config(dict(K3_VISION, shiny_new_field=3), 40)
    assert "shiny_new_field" in caplog.text


def test_preprocessor_config_sets_patch_limits(tmp_path):
    d = presets.tiny_k3_dict(vision=True)
    (tmp_path / "config.json").write_text(__import__("json").dumps(d))
    assert ModelConfig.from_file(tmp_path).vision.in_patch_limit == 16384
    (tmp_path / "preprocessor_config.json").write_text('{"media_proc_cfg": {"in_patch_limit": 65536, "patch_limit_on_one_side": 300}}')
    c = ModelConfig.from_file(tmp_path).vision
    assert (c.in_patch_limit, c.patch_limit_on_one_side) == (65536, 300)


# ---- checkpoint ---------------------------------------------------------------------------------------

def test_vision_checkpoint_round_trip_and_named_errors(tmp_path):
    model = init_weights(KimiForCausalLM(presets.tiny_k3(vision=True, mxfp4=False)))
    save_model(model, tmp_path, dtype=torch.float32)
    loaded = load_model(tmp_path, torch.float32)
    for name, t in model.state_dict().items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            assert torch.equal(loaded.state_dict()[name], t), name
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    name = "vision_tower.encoder.blocks.1.wqkv.weight"
    save_file({k: v for k, v in state.items() if k != name}, str(path))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_model(tmp_path)
    save_file({**state, name: state[name][:-1].clone()}, str(path))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in .*model.safetensors has shape"):
        load_model(tmp_path)
    save_file({**state, "vision_tower.encoder.blocks.9.wqkv.weight": state[name].clone()}, str(path))
    with pytest.raises(CheckpointError, match="unexpected tensor 'vision_tower.encoder.blocks.9.wqkv.weight'"):
        load_model(tmp_path)
