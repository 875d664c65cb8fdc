"""Linformer: keys and values compressed along the sequence into k slots by learned projections E and F.

Paper: Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity". What differs from MHA: instead of the
n keys, each query attends to k compressed slots K̄ = E·K and V̄ = F·V (E, F: k x n with n =
max_position_embeddings), so the score matrix is n x k, linear in n.

Causal form (the paper's projection mixes the future into every slot, so it cannot be causal): slot j at step t is
K̄_t[j] = sum over s <= t of E[j, s]·k_s, and V̄_t likewise with F; at t = n it is the paper's projection. It is
computed chunk by chunk: the running (K̄, V̄) of earlier chunks plus exact prefix sums inside the chunk, in
O(T·(k + chunk)·d) time and O(chunk·(k + chunk)) memory. Decoding keeps only (K̄, V̄): the cache is a state of
2·L·G·k·d_h values whatever the length, with nothing added per token. `is_causal=False` is the paper's form
(K̄ = E·K over the whole input), which cannot generate; an encoder of an encoder-decoder uses it whatever
`is_causal` says (the decoder the causal form, so `is_causal=False` is refused there).

Sharing (`linformer_sharing`, the paper's section 4): "none" (E and F per layer and key/value head), "headwise" (one
E and one F per layer), "key_value" (one E = F per layer), "layerwise" (one E = F for the whole model). E and F are
indexed by true positions (`position_ids`), so left padding changes nothing; an input longer than
max_position_embeddings is an error. `output_attentions`: None in the causal form (every step has its own compressed
keys), weights over the k slots `(B, H, T, k)` in the paper's. Deviation from the paper: the causal form above.

Packed rows (several documents in one row, `position_ids` restarting at 0, as in padding-free training): each
document is compressed on its own; the running (K̄, V̄) restart at each document's first token, and in the paper's
form every document gets its own K̄ = E·K.
"""

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.generation import GenerationMixin

from .cache_zoo import ZooStateLayer, state_layer
from .configuration_zoo import HEADS, ZooChunkedConfig, check_choice, check_positive_int, sized
from .heads_zoo import ZooForCausalLM, variant_heads
from .layers_zoo import ZooModule
from .masks_zoo import TokenMask
from .mha import ZooMultiHeadAttention
from .modeling_zoo import ZooModel
from .seq2seq_zoo import seq2seq_classes

LINFORMER_SHARING = ("none", "headwise", "key_value", "layerwise")


class ZooLinformerConfig(ZooChunkedConfig):
    """`linformer_k`: compressed slots; `linformer_sharing`: see the module docstring; `is_causal`: False for the
    paper's bidirectional form."""

    model_type = "zoo_linformer"
    paper = 'Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity"'
    arxiv = ("2006.04768",)
    presets = sized(num_attention_heads=HEADS, num_key_value_heads=(2, 2, 4), linformer_k=(16, 64, 128))
    description = "keys/values projected to k slots along the sequence (Wang 2020), causal by cumulative sums"
    cache_per_token = "0 (state: 2·L·G·k·d_h)"
    supported_position_types = ("rope", "sinusoidal", "learned", "none")
    position_table = "Linformer's E and F"

    linformer_k: int = 64
    linformer_sharing: str = "headwise"
    is_causal: bool = True

    def _check_variant(self) -> None:
        super()._check_variant()
        check_positive_int(
            self, "linformer_k", "the number of compressed key/value slots", at_most="max_position_embeddings"
        )
        check_choice("linformer_sharing", self.linformer_sharing, LINFORMER_SHARING)
        if not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal must be True (causal form) or False (the paper's), got {self.is_causal!r}.")
        if self.is_causal is False and self.has_cross_attention:
            raise ValueError(
                "is_causal=False is the paper's bidirectional form, which cannot decode, but this config builds a "
                "decoder (is_encoder_decoder or add_cross_attention): leave is_causal=True; an encoder-decoder's "
                "encoder uses the paper's form anyway."
            )


class LinformerProjection(ZooModule):
    """E (`key_projection`) and F (`value_projection`, absent when E = F), each `(P, k, n)`: P key/value heads when
    every head has its own, else 1."""

    sized_by: ClassVar[dict[str, str]] = dict.fromkeys(
        ("key_projection", "value_projection"),
        "linformer_k, max_position_embeddings (and num_key_value_heads with linformer_sharing='none')",
    )

    def __init__(self, config: ZooLinformerConfig, per_head: bool, separate_values: bool) -> None:
        super().__init__()
        shape = (config.num_key_value_heads if per_head else 1, config.linformer_k, config.max_position_embeddings)
        self.key_projection = nn.Parameter(torch.empty(shape))
        self.value_projection = nn.Parameter(torch.empty(shape)) if separate_values else None

    def init_parameters(self, config: ZooLinformerConfig) -> None:
        # a slot sums up to n projected keys: std 1/sqrt(n) keeps its scale that of one key
        std = config.max_position_embeddings**-0.5
        init.normal_(self.key_projection, mean=0.0, std=std)
        if self.value_projection is not None:
            init.normal_(self.value_projection, mean=0.0, std=std)

    def forward(self, positions: torch.LongTensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns of E and F at `positions` `(B, T)`, zero for padding: `(B, P, k, T)` each. A forward, so that
        hooks that put parameters in place around a module's forward (accelerate's offloading) see it read them."""

        def gather(projection: torch.Tensor) -> torch.Tensor:
            cols = projection[:, :, positions].permute(2, 0, 1, 3)  # (P, k, B, T) -> (B, P, k, T)
            return cols if valid is None else cols * valid[:, None, None, :].to(cols.dtype)

        keys = gather(self.key_projection)
        return keys, keys if self.value_projection is None else gather(self.value_projection)


class ZooLinformerAttention(ZooMultiHeadAttention):
    """GQA projections (and RoPE); keys and values compressed into `linformer_k` slots."""

    family = "linformer"
    # the parent's projections; the sequence projections E and F are new, fresh
    parent_weights = ("q_proj", "k_proj", "v_proj", "o_proj")
    native_format = None  # no transformers architecture computes it
    gguf_architecture = None
    backends = ("eager",)  # its own kernel
    compiles_fullgraph = False
    cache_layer = ZooStateLayer  # the compressed keys and values (K̄, V̄): nothing grows with the length
    mask_type = "tokens"
    reads_positions = True  # E and F are indexed by true positions

    def __init__(self, config: ZooLinformerConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        sharing = config.linformer_sharing
        self.projection = (
            None
            if sharing == "layerwise"
            else LinformerProjection(config, per_head=sharing == "none", separate_values=sharing != "key_value")
        )
        self.borrowed_projection: tuple[LinformerProjection, ...] = ()  # layerwise: the model's, kept out of the tree

    @classmethod
    def mixing_flops_per_token(cls, config: ZooLinformerConfig, seq_len: int) -> float:
        # per query head: scores against k slots and a weighted sum of them (4·k·d); per key/value head, folding a
        # token into K̄ and V̄ (4·k·d). The causal form adds its exact in-chunk prefix sums: q·k, ·E, p·F, ·v over c
        heads, kv_heads, slots, width = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.linformer_k,
            cls.value_width(config),
        )
        flops = 4 * heads * slots * width + 4 * kv_heads * slots * width
        if config.is_causal:
            flops += 4 * heads * min(config.query_chunk_size, seq_len) * (width + slots)
        return flops

    @classmethod
    def attention_weights_absence(cls, config: ZooLinformerConfig) -> str | None:
        if not config.is_causal:
            return None  # the paper's form: weights over the k slots
        return (
            "its causal form compresses the keys into new slots at every step, so no single map of weights over the "
            "tokens exists (the paper's form, is_causal=False, returns weights over its k slots)"
        )

    @classmethod
    def share_across_layers(cls, model: ZooModel) -> None:
        if model.config.linformer_sharing != "layerwise":
            return
        # one E = F for every layer and head: it lives on the model, and each layer borrows it
        model.shared_projection = LinformerProjection(model.config, per_head=False, separate_values=False)
        for layer in model.layers:
            layer.self_attn.borrowed_projection = (model.shared_projection,)

    @classmethod
    def bidirectional_refusal(cls, config: ZooLinformerConfig) -> str | None:
        return None  # the paper's form (`_bidirectional`), which reads `TokenMask.causal`

    @property
    def linformer_projection(self) -> LinformerProjection:
        return self.projection if self.projection is not None else self.borrowed_projection[0]

    def forward(self, hidden_states, attention_mask: TokenMask, position_embeddings=None, cache=None, **kwargs):
        batch, length = hidden_states.shape[:2]
        query, key, value = self.project(hidden_states, position_embeddings)  # (B, H, T, d), (B, G, T, d) x 2
        positions = kwargs["position_ids"].expand(batch, -1)  # (B, T) true positions
        if not torch.compiler.is_compiling():
            self.config.check_position_table(int(positions.max()))
        # (B, P, k, T) x 2, zero at padding
        key_columns, value_columns = self.linformer_projection(positions, attention_mask.padding)
        documents = attention_mask.documents
        layer = state_layer(cache, self.layer_idx, self.config.model_type)
        weights = None
        if self.config.is_causal and attention_mask.causal:
            state = layer and layer.read()
            output, state = self._causal(query, key, value, key_columns, value_columns, state, documents)
        else:
            if layer is not None and layer.get_seq_length() > 0:
                raise ValueError("linformer with is_causal=False sees the whole input at once: it cannot decode.")
            output, weights = self._bidirectional(query, key, value, key_columns, value_columns, documents)
            state = {}
        if layer is not None:
            layer.write(state, length)
        return self.o_proj(output.reshape(batch, length, -1)), weights

    def _causal(self, query, key, value, key_columns, value_columns, state, documents=None):
        """Chunk by chunk: running (K̄, V̄) from earlier chunks plus exact prefix sums inside the chunk. With
        `documents` `(B, T)` (a packed row), a query reads the running sums only when they belong to its document,
        prefix sums inside a chunk stay within a document, and the sums restart when a document ends."""
        batch, heads, length, head_dim = query.shape
        kv_heads, slots = key.shape[1], key_columns.shape[2]
        groups = heads // kv_heads
        if state is None:
            state = {name: query.new_zeros(batch, kv_heads, slots, head_dim) for name in ("keys", "values")}
        compressed_keys, compressed_values = state["keys"], state["values"]  # (B, G, k, d)
        key_columns = key_columns.expand(batch, kv_heads, -1, -1)  # (B, G, k, T): one E per head, or shared
        value_columns = value_columns.expand(batch, kv_heads, -1, -1)
        exporting = torch.compiler.is_exporting()
        # a graph cannot loop over a dynamic length (range() would fix it): while exporting, one chunk of every token,
        # O(T²) memory, the same sums
        chunk = length if exporting else self.config.query_chunk_size
        starts = (0,) if exporting else range(0, length, chunk)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).tril()
        state_document = None if documents is None else documents[:, 0]  # (B,): the document the sums belong to
        outputs = []
        for start in starts:
            end = min(length, start + chunk)
            size = end - start
            within = causal[:size, :size]  # key s <= query t inside the chunk
            reads_state = None
            if documents is not None:
                chunk_documents = documents[:, start:end]  # (B, c)
                same = chunk_documents[:, :, None] == chunk_documents[:, None, :]  # (B, c, c)
                within = (within & same)[:, None, None]  # (B, 1, 1, c, c)
                reads_state = (chunk_documents == state_document[:, None])[:, None, None, :, None]  # (B, 1, 1, c, 1)
            # group query heads by their key/value head: (B, H, c, d) -> (B, G, H/G, c, d)
            q = query[:, :, start:end].reshape(batch, kv_heads, groups, size, head_dim)
            e = key_columns[:, :, None, :, start:end]  # (B, G, 1, k, c)
            f = value_columns[:, :, None, :, start:end]
            k, v = key[:, :, None, start:end], value[:, :, None, start:end]  # (B, G, 1, c, d)
            # scores against slot j at step t: q_t·K̄_prev[j] + sum over s <= t in the chunk of E[j, s]·(q_t·k_s)
            scores = q @ compressed_keys[:, :, None].transpose(-1, -2)  # (B, G, H/G, c, k)
            if reads_state is not None:
                scores = scores.masked_fill(~reads_state, 0.0)
            scores = scores + (q @ k.transpose(-1, -2)).masked_fill(~within, 0.0) @ e.transpose(-1, -2)
            probabilities = F.softmax(scores * self.scaling, dim=-1, dtype=torch.float32).to(query.dtype)
            probabilities = F.dropout(probabilities, self.attention_dropout, training=self.training)
            # output: p_t·V̄_prev + sum over s <= t in the chunk of (p_t·F[:, s])·v_s
            out = probabilities @ compressed_values[:, :, None]  # (B, G, H/G, c, d)
            if reads_state is not None:
                out = out.masked_fill(~reads_state, 0.0)
            out = out + (probabilities @ f).masked_fill(~within, 0.0) @ v
            outputs.append(out.reshape(batch, heads, size, head_dim))
            e_new, f_new = e[:, :, 0], f[:, :, 0]  # (B, G, k, c)
            if documents is not None:
                # the sums carried on hold the document of the chunk's last token: earlier ones end here
                last_document = chunk_documents[:, -1]  # (B,)
                keep = (state_document == last_document)[:, None, None, None]  # (B, 1, 1, 1)
                compressed_keys, compressed_values = compressed_keys * keep, compressed_values * keep
                in_last = (chunk_documents == last_document[:, None])[:, None, None, :]  # (B, 1, 1, c)
                e_new, f_new = e_new * in_last, f_new * in_last
                state_document = last_document
            compressed_keys = compressed_keys + e_new @ k[:, :, 0]  # (B, G, k, c) @ (B, G, c, d)
            compressed_values = compressed_values + f_new @ v[:, :, 0]
        output = torch.cat(outputs, dim=2).transpose(1, 2)  # (B, H, T, d) -> (B, T, H, d)
        return output, {"keys": compressed_keys, "values": compressed_values}

    def _bidirectional(self, query, key, value, key_columns, value_columns, documents=None):
        """The paper's form: K̄ = E·K and V̄ = F·V over the whole input (over each document of a packed row)."""
        batch, heads, length, head_dim = query.shape
        kv_heads = key.shape[1]
        q = query.reshape(batch, kv_heads, heads // kv_heads, length, head_dim)  # (B, G, H/G, T, d)
        if documents is not None:
            return self._bidirectional_packed(q, key, value, key_columns, value_columns, documents)
        compressed_keys = key_columns @ key  # (B, P, k, T) @ (B, G, T, d) -> (B, G, k, d)
        compressed_values = value_columns @ value
        scores = q @ compressed_keys[:, :, None].transpose(-1, -2) * self.scaling  # (B, G, H/G, T, k)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        dropped = F.dropout(probabilities, self.attention_dropout, training=self.training)
        output = (dropped @ compressed_values[:, :, None]).reshape(batch, heads, length, head_dim)
        return output.transpose(1, 2), probabilities.reshape(batch, heads, length, -1)

    def _bidirectional_packed(self, q, key, value, key_columns, value_columns, documents):
        """The paper's form per document: K̄_n = Σ_{s in n} E[:, s]·k_s for each document n, read by its own
        queries. `q` `(B, G, H/G, T, d)`, `documents` `(B, T)`."""
        batch, kv_heads, groups, length, head_dim = q.shape
        membership = F.one_hot(documents).to(key.dtype)  # (B, T, N)
        key_columns = key_columns.expand(-1, kv_heads, -1, -1)  # (B, G, k, T)
        value_columns = value_columns.expand(-1, kv_heads, -1, -1)
        compressed_keys = torch.einsum("bgkt,btn,bgtd->bgnkd", key_columns, membership, key)  # (B, G, N, k, d)
        compressed_values = torch.einsum("bgkt,btn,bgtd->bgnkd", value_columns, membership, value)
        index = documents[:, None, :, None, None].expand(-1, kv_heads, -1, *compressed_keys.shape[-2:])
        own_keys = compressed_keys.gather(2, index)  # (B, G, T, k, d): each token's document's slots
        own_values = compressed_values.gather(2, index)
        scores = torch.einsum("bghtd,bgtkd->bghtk", q, own_keys) * self.scaling  # (B, G, H/G, T, k)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        dropped = F.dropout(probabilities, self.attention_dropout, training=self.training)
        output = torch.einsum("bghtk,bgtkd->bghtd", dropped, own_values).reshape(batch, -1, length, head_dim)
        return output.transpose(1, 2), probabilities.reshape(batch, kv_heads * groups, length, -1)


class ZooLinformerModel(ZooModel):
    config_class = ZooLinformerConfig
    attention_class = ZooLinformerAttention


class ZooLinformerForCausalLM(ZooForCausalLM, GenerationMixin):
    """Refuses to generate when the projection is not causal: its own head, which `variant_heads` returns as is."""

    base_model_class = ZooLinformerModel

    def generate(self, *args, **kwargs):
        if not self.config.is_causal:
            raise ValueError(
                "this linformer has is_causal=False: its projection runs over the whole input, future included, so "
                "it cannot generate; build it with is_causal=True."
            )
        return super().generate(*args, **kwargs)


# the causal LM above is returned as declared
(
    _,
    ZooLinformerForSequenceClassification,
    ZooLinformerForTokenClassification,
    ZooLinformerForQuestionAnswering,
) = variant_heads(ZooLinformerModel)
ZooLinformerEncoder, ZooLinformerDecoder, ZooLinformerSeq2SeqModel, ZooLinformerForConditionalGeneration = (
    seq2seq_classes(ZooLinformerModel)
)
