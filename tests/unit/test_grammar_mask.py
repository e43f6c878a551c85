"""core.grammar.GrammarMask walks drafts and rolls back to exactly where it stood, also past the grammar's
end: llguidance takes a stopped grammar's EOS without recording it, and rolling it back undid one
committed token too many (the next review then allowed what the grammar refuses)."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from cascade_service.core.grammar import GrammarMask, ResponseFormat, grammar_tokenizer

REGEX = r"[0-9]{3}-[a-z]{2,4}"


def _mask(family) -> tuple[GrammarMask, object]:
    tokenizer = AutoTokenizer.from_pretrained(family["target"])
    return GrammarMask(grammar_tokenizer(tokenizer), ResponseFormat("regex", REGEX), len(tokenizer)), tokenizer


def test_masks_past_the_grammars_end_leave_the_state_where_it_was(tiny_family):
    mask, tokenizer = _mask(tiny_family)
    ids = tokenizer.convert_tokens_to_ids
    mask.advance([ids("1"), ids("2"), ids("3")])
    prompt = [5, 6]
    mask.anchor(len(prompt) + 3)
    context = prompt + [ids("1"), ids("2"), ids("3")]
    before = mask.mask(context)
    letters = [ids("-"), ids("m"), ids("o"), ids("u"), ids("r")]
    block = [*letters, tokenizer.eos_token_id]
    valid, rows = mask.masks(context, block)
    assert valid == len(block) and rows.shape == (len(block) + 1, len(tokenizer))
    eos_only = torch.zeros(len(tokenizer), dtype=torch.bool)
    eos_only[tokenizer.eos_token_id] = True
    assert torch.equal(rows[len(letters)], eos_only)  # four letters: only EOS may follow
    assert torch.equal(mask.mask(context), before)  # rolled back to the three digits, no further
    assert before[ids("-")] and not before[ids("4")]  # three digits stand: a dash next
    # A drafter's context that already holds a refused draft gets no mask: drafting stops there.
    assert mask.mask(context + [ids("x")]) is None
    mask.advance(block)  # the committed output may end with the grammar's EOS
