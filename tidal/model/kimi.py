"""The Kimi-K3 / Kimi Linear language model: embed -> [KDA | MLA] x [MLP | MoE] (+AttnRes) -> norm -> lm_head."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.attn_res import attn_res_glue, attn_res_params, attn_res_query
from tidal.model.context import ForwardBatch
from tidal.model.kda import KimiDeltaAttention
from tidal.model.layers import (Embedding, RMSNorm, compute_dtype, derived_weight, inference_layout, kept_derived,
                                 linear)
from tidal.model.mla import KimiMLA
from tidal.model.moe import KimiMLP, KimiMoE
from tidal.model.vision.tower import MoonViT, PatchMergerProjector
from tidal.ops import batch_invariant, fused_decode

# Parameters kept in float32 (float64 in a float64 model) whatever the model dtype.
FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        d = config.hidden_size
        if config.is_kda_layer(layer):
            self.self_attn: nn.Module = KimiDeltaAttention(config, config.kda_index(layer))
        else:
            self.self_attn = KimiMLA(config, config.mla_index(layer))
        if config.is_moe_layer(layer):
            self.block_sparse_moe = KimiMoE(config)
        else:
            self.mlp = KimiMLP(config, d, config.intermediate_size)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        if config.attn_res_block_size:
            attn_res_params(self, "self_attention_res", d)
            attn_res_params(self, "mlp_res", d)

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward sub-layer (MoE or dense MLP), without its input norm."""
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.post_attention_layernorm(x))

    def attention(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), batch)


class KimiModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.attn_res_block_size:
            attn_res_params(self, "output_attn_res", d)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T] (the batch's new tokens, concatenated) -> final-normed hidden [T, d].
        ``image_embeds`` = (positions [k] in the run, embeddings [k, d]): the image features that
        replace those placeholder tokens' embeddings. For each layer i in ``batch.tap_layers`` the
        hidden state after layer i (the next layer's input; after the last, the output before the
        final norm) is kept in ``batch.taps[i]``."""
        h = self.embed_tokens(input_ids)
        if image_embeds is not None:
            positions, embeds = image_embeds
            h[positions] = embeds.to(h.dtype)
        if self.config.attn_res_block_size:
            stepped = self._decode_step(h, batch) if image_embeds is None else None
            return stepped if stepped is not None else self._forward_attn_res(h, batch)
        for i, layer in enumerate(self.layers):
            h = h + layer.attention(h, batch)
            h = h + layer.feed_forward(h)
            if i in batch.tap_layers:
                batch.taps[i] = h
        return self.norm(h)

    def _decode_step(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """:meth:`_forward_attn_res` of a bfloat16 decode step (one new token per sequence) in one C
        call over the engine's pool (``fused_decode.model_decode_step``: the layers' one-call steps
        and the glue between them, with their bits), or None where it does not apply (a layer that
        does not take its one-call step, taps asked for, another cache, batch invariance)."""
        if (h.dtype != torch.bfloat16 or not h.is_cpu or h.dim() != 2 or not batch.is_decode or batch.tap_layers
                or len(batch.decode_seqs) != h.shape[0] or batch_invariant.enabled()
                or not hasattr(batch.cache, "mla_write_rows")):
            return None
        plan = self._model_step_plan()
        if not plan:
            return None
        cache = batch.cache
        kda, pages, table, lengths, write = [], [], None, None, None
        for layer in self.layers:
            attn = layer.self_attn
            if isinstance(attn, KimiDeltaAttention):
                kda.append(cache.kda_storage(attn.kda_index))
                continue
            write = cache.mla_write_rows() if write is None else write
            if write is None:
                return None
            layer_pages, table, lengths = cache.mla_pages(attn.mla_index, batch.decode_seqs)
            pages.append(layer_pages)
        return fused_decode.model_decode_step(plan, h, batch.decode_slots(h.device), kda, pages, table, lengths, write)

    @kept_derived("_model_step_plan_cached")
    def _model_step_plan(self) -> fused_decode.ModelStepPlan | bool:
        """The plan of :meth:`_decode_step` (kept while no weight changes), or False where a layer does
        not take its one-call step."""
        return derived_weight(self, "_model_step_plan_cached", (*self.parameters(), *self.buffers()), self._step_plan)

    def _step_plan(self) -> fused_decode.ModelStepPlan | bool:
        """The plan of :meth:`_decode_step` built from the layers' own plans (False: does not apply)."""
        steps = []
        for layer in self.layers:
            attn, ffn = layer.self_attn, layer.ffn
            attn_plan, ffn_plan = attn.decode_step_plan(), ffn.decode_step_plan()
            glues = [(attn_res_query(layer, prefix), norm.weight, norm.eps)
                     for prefix, norm in (("self_attention_res", layer.input_layernorm),
                                          ("mlp_res", layer.post_attention_layernorm))]
            if attn_plan is None or ffn_plan is None or any(q is None for q, _, _ in glues):
                return False
            steps.append(fused_decode.LayerSteps(
                attn_plan, fused_decode.KDA if isinstance(attn, KimiDeltaAttention) else fused_decode.MLA,
                ffn_plan, fused_decode.MOE if isinstance(ffn, KimiMoE) else fused_decode.DENSE_MLP, *glues))
        query = attn_res_query(self, "output_attn_res")
        if query is None:
            return False
        c = self.config
        plan = fused_decode.model_step_plan(steps, (query, self.norm.weight, self.norm.eps), c.hidden_size,
                                            c.attn_res_block_size, c.rms_norm_eps)
        return plan if plan is not None else False

    def _forward_attn_res(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Block AttnRes control flow, spec §4.3: blocks B, partial sum P (None = empty) -> the final
        norm of the output AttnRes. A sub-layer's output is added to P by the glue that follows it
        (``attn_res_glue``: P + out, AttnRes and the next norm, one C call on a decode step)."""
        eps = self.config.rms_norm_eps
        size = self.config.attn_res_block_size
        blocks: list[torch.Tensor] = []
        block_cache = fused_decode.BlockCache()  # what a kernel computes once per completed block
        partial: torch.Tensor | None = h
        add: torch.Tensor | None = None  # the last sub-layer's output, not yet in partial
        for i, layer in enumerate(self.layers):
            assert partial is not None
            partial, a, x = attn_res_glue(layer, "self_attention_res", partial, add, blocks, eps, block_cache,
                                          layer.input_layernorm)
            if i - 1 in batch.tap_layers:
                batch.taps[i - 1] = a
            if i % size == 0:
                blocks.append(partial)
                partial = None
            out = layer.self_attn(x, batch)
            partial, add = (out, None) if partial is None else (partial, out)
            partial, _, x = attn_res_glue(layer, "mlp_res", partial, add, blocks, eps, block_cache,
                                          layer.post_attention_layernorm)
            add = layer.ffn(x)
        assert partial is not None
        _, out, x = attn_res_glue(self, "output_attn_res", partial, add, blocks, eps, block_cache, self.norm)
        if len(self.layers) - 1 in batch.tap_layers:
            batch.taps[len(self.layers) - 1] = out
        return x


class KimiForCausalLM(nn.Module):
    """State-dict names equal Kimi Linear's checkpoint names (``model.*``, ``lm_head.weight``);
    Kimi-K3 checkpoints add the ``language_model.`` prefix (handled by the loader)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = KimiModel(config)
        self.lm_head = linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.vision is not None:  # the checkpoint's own names: vision_tower.*, mm_projector.*
            self.vision_tower = MoonViT(config.vision)
            self.mm_projector = PatchMergerProjector(config.vision)

    @property
    def has_vision(self) -> bool:
        return hasattr(self, "vision_tower")

    def embed_image(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image's patches [h * w, 3, p, p] -> its placeholder embeddings [h*w / 4, hidden]."""
        if not self.has_vision:
            raise ValueError("this model takes no images")
        return self.mm_projector(self.vision_tower(patches.to(self.vision_tower.patch_embed.proj.weight), grid))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.model(input_ids, batch, image_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 (float64 for a float64 model)."""
        return self.lm_head(hidden).to(compute_dtype(hidden.dtype))

    def process_weights_after_loading(self) -> "KimiForCausalLM":
        """Ready loaded weights for serving (the engine calls it; values and state_dict names do not
        change): fuse the projections that read the same input, in every module that can, and store
        the remaining dense weights in ``inference_layout``. Call after any ``to_dtype``."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_weights"):
                module.fuse_weights()
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not self.model.embed_tokens.weight:
                module.weight.data = inference_layout(module.weight)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def to_dtype(self, dtype: torch.dtype) -> "KimiForCausalLM":
        """Cast to ``dtype``, keeping FP32_PARAMS in float32 (or wider)."""
        keep = compute_dtype(dtype)
        for name, p in self.named_parameters():
            target = keep if name.rsplit(".", 1)[-1] in FP32_PARAMS else dtype
            p.data = p.data.to(target)
        return self
