"""Index arithmetic shared by the torch reference and the torch backend.

Everything here is vectorised over requests: the number of torch ops does not grow
with the batch size, only the size of the tensors does.
"""

from __future__ import annotations

import torch


def context_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, block_size: int
) -> torch.Tensor:
    """Cache slots of context positions ``0..max_len-1`` for every request.

    Returns ``[B, max_len]`` int64. Positions at or past ``seq_lens[b]`` point at the
    request's position-0 slot, which always holds finite, written K/V, so a masked
    gather never reads uninitialised memory.
    """
    device = block_tables.device
    pos = torch.arange(max_len, device=device)
    block_idx = torch.div(pos, block_size, rounding_mode="floor")
    block_idx = block_idx.clamp_(max=max(block_tables.shape[1] - 1, 0))
    tables = block_tables.long()
    slots = tables.index_select(1, block_idx) * block_size + (pos % block_size)
    first = tables[:, :1] * block_size
    inside = pos[None, :] < seq_lens.to(device=device, dtype=torch.long)[:, None]
    return torch.where(inside, slots, first)


def padded_query_rows(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_q_len: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay varlen query chunks out as a padded ``[B, max_q_len]`` grid.

    Returns ``(token_index, position, valid)``, each ``[B, max_q_len]``:

    * ``token_index``: row of the flat query each grid cell reads (padding cells
      repeat the request's last token, so they stay finite);
    * ``position``: absolute context position of the cell's query token (padding
      cells use the last position, i.e. they attend to the whole context);
    * ``valid``: the cell holds a real query token.
    """
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    return padded_rows(starts, q_lens, seq_lens, max_q_len, num_tokens)


def padded_rows(
    starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor, max_q_len: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`padded_query_rows` for chunks given by first token row and length
    (int64), which need not be adjacent or in order."""
    device = starts.device
    j = torch.arange(max_q_len, device=device)[None, :]
    valid = j < q_lens[:, None]
    j_clamped = torch.minimum(j, (q_lens[:, None] - 1).clamp(min=0))
    token_index = (starts[:, None] + j_clamped).clamp_(0, max(num_tokens - 1, 0))
    prefix = seq_lens.to(device=device, dtype=torch.long)[:, None] - q_lens[:, None]
    position = prefix + j_clamped
    return token_index, position, valid


def flat_to_padded_index(
    query_start_loc: torch.Tensor, max_q_len: int, num_tokens: int
) -> torch.Tensor:
    """For each flat query token (in order), its index in the flattened padded grid.

    ``num_tokens`` must equal ``query_start_loc[-1] - query_start_loc[0]``; passing it
    from host-side metadata avoids a device sync.
    """
    device = query_start_loc.device
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    req = torch.repeat_interleave(
        torch.arange(q_lens.numel(), device=device), q_lens, output_size=num_tokens
    )
    t = torch.arange(num_tokens, device=device) + query_start_loc[0].long()
    return req * max_q_len + (t - starts.index_select(0, req))
