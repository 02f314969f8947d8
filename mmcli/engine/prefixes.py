"""Prefix sharing: the items of one group (an image's tasks) share their first tokens, which are
prefilled once, in the first member's cache row, and copied to the others' rows (a pure plan)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mmcli.engine.batch import PrefillItem


@dataclass
class PrefixPlan:
    prefixes: list[PrefillItem]  # each shared prefix, in its group's first row
    copies: list[tuple[int, int, int]]  # (source row, target row, tokens)
    rest: list[PrefillItem]  # the items with only their own tokens left, after the prefix


def share_prefixes(items: list[PrefillItem]) -> PrefixPlan | None:
    """The plan for `items`, or None where no group has two members."""
    groups: dict[str, list[PrefillItem]] = {}
    for item in items:
        if item.group is not None and item.prefix_len > 0:
            groups.setdefault(item.group, []).append(item)
    shared = [members for members in groups.values() if len(members) > 1]
    if not shared:
        return None
    plan = PrefixPlan([], [], list(items))
    for members in shared:
        n = min(min(m.prefix_len for m in members), min(len(m.input_ids) for m in members) - 1)
        lead = members[0]
        plan.prefixes.append(
            replace(
                lead,
                input_ids=lead.input_ids[:n],
                rotary_position_ids=lead.rotary_position_ids[:, :n],
                max_tokens=max(m.max_tokens for m in members),
                group=None,
                prefix_len=0,
            )
        )
        for member in members:
            plan.copies.append((lead.slot, member.slot, n))
            plan.rest[items.index(member)] = PrefillItem(
                slot=member.slot,
                input_ids=member.input_ids[n:],
                rotary_position_ids=member.rotary_position_ids[:, n:],
                pixel_values=[],  # the prefix holds the vision tokens
                vision_grids=[],
                max_tokens=member.max_tokens,
                start=n,
            )
    return plan
