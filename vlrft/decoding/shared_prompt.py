"""A prompt's KV cache held once for its group of rows (`LeanDecoder(share_prompt=True)`; docs/decoding.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedPrompt:
    """Each prompt's keys and values held once for its group of rows, not copied per row (docs/decoding.md).

    A row's query heads meet its prompt's keys in one batch per prompt and KV head, its own generated positions in
    one per row and KV head, and one softmax spans both: exactly the attention over the concatenated cache. Rows
    dropped by `keep` leave empty places (zero queries, outputs dropped) in the prompt-by-prompt layout (`slots`).
    """

    keys: list[torch.Tensor]  # per layer [prompts * kv_heads, prompt_len, head_dim]
    values: list[torch.Tensor]
    bias: torch.Tensor  # [prompts * kv_heads, 1, prompt_len]: 0 on a prompt's tokens, -inf on its left padding
    prompts: int
    group: int
    slots: torch.Tensor | None = None  # each row's place in the prompts x group layout (None: row i is place i)

    @classmethod
    def of(cls, prefill_cache, rows: torch.Tensor, prompt_mask: torch.Tensor,
           dtype: torch.dtype | None) -> "SharedPrompt":
        """From the prefill's cache (one row per prompt); `rows` must be each prompt's rows together, as many for
        each (decode_groups' order); `prompt_mask` is per row."""
        first = prefill_cache.layers[0].keys
        prompts, kv_heads, prompt_len = first.shape[0], first.shape[1], prompt_mask.shape[1]
        group = len(rows) // prompts
        in_order = torch.arange(prompts, device=rows.device).repeat_interleave(group)
        if len(rows) != prompts * group or not torch.equal(rows, in_order):
            raise ValueError("share_prompt: `rows` must list each prompt's rows together, as many for every prompt "
                             "(the order decode_groups decodes in)")

        def flat(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor[:, :, :prompt_len].to(dtype or tensor.dtype)
            return tensor.reshape(prompts * kv_heads, prompt_len, tensor.shape[-1])

        keys = [flat(layer.keys) for layer in prefill_cache.layers]
        values = [flat(layer.values) for layer in prefill_cache.layers]
        padding = ~prompt_mask[::group].bool()[:, None, None, :].expand(prompts, kv_heads, 1, prompt_len)
        bias = torch.zeros(padding.shape, dtype=keys[0].dtype, device=prompt_mask.device)
        bias.masked_fill_(padding, float("-inf"))
        return cls(keys, values, bias.view(prompts * kv_heads, 1, prompt_len), prompts, group)

    def keep(self, index: torch.Tensor) -> None:
        """Rows `index` of the current ones go on (the others stopped)."""
        self.slots = index if self.slots is None else self.slots.index_select(0, index)

    def _to_places(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row `x` [rows, ...] in the prompts x group layout (empty places zero)."""
        if self.slots is None:
            return x
        return x.new_zeros(self.prompts * self.group, *x.shape[1:]).index_copy_(0, self.slots, x)

    def attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """One new query per row, `q` [rows, heads, dim], over its prompt and over its own generated positions
        (`keys`, `values` [rows * kv_heads, length, dim], `bias` [rows * kv_heads, 1, length]): [rows, heads * dim]."""
        rows, heads, dim = q.shape
        kv_heads, prompts, group = self.bias.shape[0] // self.prompts, self.prompts, self.group
        per_kv = heads // kv_heads
        prompt_keys, prompt_values = self.keys[layer], self.values[layer]
        prompt_len = prompt_keys.shape[1]

        def by_prompt(x: torch.Tensor) -> torch.Tensor:  # [places, kv, per_kv, n] -> [prompts * kv, group * per_kv, n]
            x = x.view(prompts, group, kv_heads, per_kv, x.shape[-1]).transpose(1, 2)
            return x.reshape(prompts * kv_heads, group * per_kv, x.shape[-1])

        def by_row(x: torch.Tensor) -> torch.Tensor:  # the inverse, then back to the current rows
            x = x.view(prompts, kv_heads, group, per_kv, x.shape[-1]).transpose(1, 2)
            x = x.reshape(prompts * group, kv_heads, per_kv, x.shape[-1])
            return x if self.slots is None else x.index_select(0, self.slots)

        # bf16 products over the cache as it is, a float32 softmax, the halves added once (docs/decoding.md)
        grouped = torch.empty((rows, kv_heads, per_kv, dim), dtype=keys.dtype, device=q.device)
        grouped.copy_(q.view(rows, kv_heads, per_kv, dim))
        prompt_scores = torch.baddbmm(self.bias, by_prompt(self._to_places(grouped)), prompt_keys.transpose(1, 2),
                                      alpha=scaling)
        own_scores = torch.baddbmm(bias, grouped.view(rows * kv_heads, per_kv, dim), keys.transpose(1, 2),
                                   alpha=scaling)
        scores = torch.cat([by_row(prompt_scores).reshape(rows * kv_heads, per_kv, prompt_len),
                            own_scores.to(prompt_scores.dtype)], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(keys.dtype)
        prompt_probs, own_probs = probs.split([prompt_len, probs.shape[-1] - prompt_len], dim=-1)
        prompt_probs = self._to_places(prompt_probs.reshape(rows, kv_heads, per_kv, prompt_len))
        from_prompt = by_row(torch.bmm(by_prompt(prompt_probs), prompt_values))  # [rows, kv, per_kv, dim]
        own = torch.bmm(own_probs, values)
        return (from_prompt.reshape(rows * kv_heads, per_kv, dim) + own).view(rows, -1)
