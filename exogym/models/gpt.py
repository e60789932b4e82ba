"""A GPT-style causal transformer for token ids (character-level Shakespeare and the like), nanoGPT-sized by arguments.

Pre-LayerNorm blocks (Radford et al. 2019): x + attention(LN(x)), then x + MLP(LN(x)); learned position
embeddings; the output layer shares the token embedding's weights (Press & Wolf 2017). Weights start
at N(0, 0.02), and the projections back into the residual stream at N(0, 0.02 / sqrt(2 * n_layer)),
so the residual stream's variance does not grow with depth (GPT-2). At that scale the logits start
near zero, and so the loss near ln(vocab_size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from exogym._validation import check_int

__all__ = ["GPT"]


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)  # into the residual stream
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # [B, T, 3C] -> three [B, n_head, T, C / n_head]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        # softmax(q k^T / sqrt(d) + causal mask) v: position t attends to positions <= t only.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)  # heads side by side again: [B, T, C]
        return self.resid_dropout(self.proj(y))


class _MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)  # into the residual stream
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_attn, self.attn = nn.LayerNorm(n_embd), _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_mlp, self.mlp = nn.LayerNorm(n_embd), _MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """A small GPT: `model((idx, targets))` -> `{"loss", "accuracy"}`; idx, targets int64 `[B, T]`, T <= block_size.

    loss is the mean cross-entropy of predicting `targets[b, t]` (the token after `idx[b, t]`) from
    `idx[b, :t+1]`; accuracy the fraction predicted exactly by the most likely token. `logits(idx)` gives the
    `[B, T, vocab_size]` scores, `generate` continues a prompt. About 12 x n_layer x n_embd^2 weights plus
    (vocab_size + block_size) x n_embd for the embeddings.

    Args:
        vocab_size: The number of token ids.
        block_size: The longest context, in tokens.
        n_layer: Transformer blocks.
        n_head: Attention heads per block (must divide `n_embd`).
        n_embd: The embedding width.
        dropout: Dropout in attention and MLP outputs.

    Raises:
        ValueError: `n_head` does not divide `n_embd`, or a size below 1.
    """

    def __init__(self, vocab_size: int, block_size: int, *, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
                 dropout: float = 0.0):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            check_int(name, value, minimum=1)
        if n_embd % n_head:
            divisors = [h for h in range(1, n_embd + 1) if n_embd % h == 0 and h <= 64]
            raise ValueError(f"n_head must divide n_embd={n_embd} (each head gets n_embd / n_head channels), "
                             f"got n_head={n_head}; use one of {divisors}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # one matrix reads tokens in and scores them out
        self._init_weights(n_layer)

    @torch.no_grad()
    def _init_weights(self, n_layer: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # each block adds two of these to the residual stream
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Scores for the next token at every position.

        Args:
            idx: Token ids, int64 `[B, T]`, T <= block_size.

        Returns:
            float `[B, T, vocab_size]`.
        """
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}; use at most "
                             f"{self.block_size} tokens (generate crops the context itself)")
        positions = torch.arange(T, device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(positions))  # [B, T, n_embd]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [B, T, vocab_size]

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss and accuracy of a batch.

        Args:
            batch: `(idx, targets)`, int64 `[B, T]` each.

        Returns:
            `{"loss": mean cross-entropy, "accuracy": fraction of targets predicted}`.
        """
        idx, targets = batch
        logits = self.logits(idx)  # [B, T, V]
        return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
                "accuracy": (logits.argmax(dim=-1) == targets).float().mean()}

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue `idx` by `max_new_tokens` sampled tokens.

        Each step looks at the last block_size tokens, divides the logits by `temperature`, keeps the `top_k` most
        likely and samples. Runs in eval mode (no dropout) and restores the model's mode afterwards.

        Args:
            idx: The prompt, int64 `[B, T]`.
            max_new_tokens: How many tokens to add.
            temperature: Divides the logits: < 1 favours more likely tokens, > 1 gives more varied ones.
            top_k: Sample among the k most likely tokens (all when None).
            generator: A torch.Generator on the model's device: reproducible sampling without touching the global
                random stream.

        Returns:
            int64 `[B, T + max_new_tokens]`.
        """
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        if top_k is not None:
            check_int("top_k", top_k, minimum=1)
            if top_k > self.vocab_size:
                raise ValueError(f"top_k must be at most vocab_size={self.vocab_size}, got {top_k}; "
                                 "use None to sample from every token")
        if idx.dim() != 2 or idx.shape[1] < 1 or idx.is_floating_point():
            raise ValueError(f"idx must be int64 token ids of shape [B, T] with T >= 1, got {idx.dtype} "
                             f"{list(idx.shape)}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self.logits(idx[:, -self.block_size:])[:, -1, :] / temperature  # [B, V]
                if top_k is not None:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)  # [B, T + 1]
        finally:
            self.train(was_training)
        return idx
