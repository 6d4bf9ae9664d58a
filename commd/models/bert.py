"""A BERT-base-like transformer encoder with a sequence-classification head.

Same shapes as Hugging Face's ``BertModel`` (bert-base-uncased) plus a 2-class head:
12 layers, hidden 768, 12 heads, FFN 3072, vocabulary 30522, 512 positions, 2 token types;
201 parameter tensors, 109,483,778 parameters (109,482,240 of them the encoder + pooler).
Every projection is its own ``nn.Linear`` (query, key and value separately, not
``nn.MultiheadAttention``'s packed ``in_proj``), so each weight is a separate gradient tensor,
as in the usual BERT implementations whose layer lists the communication literature uses.
Parameter names are shorter than Hugging Face's; order is the same (forward order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Bert", "BertConfig", "bert_base"]


@dataclass(frozen=True)
class BertConfig:
    """The encoder's shapes; the defaults are bert-base-uncased's, with a 2-class head."""

    vocab_size: int = 30522
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn: int = 3072
    max_positions: int = 512
    token_types: int = 2
    dropout: float = 0.1
    num_classes: int = 2
    eps: float = 1e-12  # BERT's LayerNorm epsilon


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate query, key, value and output projections, each its
    own gradient tensor, and torch's fused scaled dot-product attention."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, heads, s, h/heads)
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        # The fused kernel is what a real training run would use (and is much faster on CPU).
        ctx = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
            attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
        )  # fmt: skip
        out: torch.Tensor = self.out(ctx.transpose(1, 2).reshape(b, s, h))
        return out


class EncoderLayer(nn.Module):
    """Post-norm transformer layer, as in BERT."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.ffn_in = nn.Linear(cfg.hidden, cfg.ffn)
        self.ffn_out = nn.Linear(cfg.ffn, cfg.hidden)
        self.ffn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attn_norm(x + self.drop(self.attn(x, mask)))
        y = self.ffn_out(F.gelu(self.ffn_in(x)))
        out: torch.Tensor = self.ffn_norm(x + self.drop(y))
        return out


class Bert(nn.Module):
    """Encoder + pooler + classifier; ``forward(input_ids, token_type_ids, attention_mask)``."""

    def __init__(self, cfg: BertConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or BertConfig()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.token_types, cfg.hidden)
        self.embed_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes)
        # BERT's initialisation: N(0, 0.02) weights, zero biases, identity LayerNorms.
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(batch, seq) token ids -> (batch, num_classes) logits from the [CLS] position."""
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.drop(self.embed_norm(x))
        # attention_mask: 1 = attend, 0 = padding; broadcast over heads and query positions.
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        logits: torch.Tensor = self.classifier(self.drop(pooled))
        return logits


def bert_base(num_classes: int = 2) -> Bert:
    """BERT-base encoder with a ``num_classes``-way classification head (~110 M parameters)."""
    return Bert(BertConfig(num_classes=num_classes))
