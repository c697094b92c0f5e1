"""Which drafter a placement's requests speculate with, and why: from the ``speculative`` setting,
the model's files and how this node serves it. Pure."""

from __future__ import annotations

from dataclasses import dataclass

MTP, PROMPT_LOOKUP, DRAFT_MODEL, OFF = "mtp", "prompt_lookup", "draft_model", "off"


@dataclass(frozen=True)
class DrafterChoice:
    kind: str  # MTP, PROMPT_LOOKUP, DRAFT_MODEL or OFF
    why: str

    def describe(self) -> str:
        """As ``meshnode status`` shows it: "mtp: the model's own head (1 layer, float32)"."""
        return f"{self.kind}: {self.why}"


@dataclass(frozen=True)
class MTPState:
    """The model's MTP head as this placement sees it."""

    present: bool = False  # the model's files carry one (and the setting may draft with it)
    whole: bool = False  # this node runs every layer of the plan, alone
    steps_batched: bool = False  # a request's decode steps may run in a batch on another thread
    loaded: str = ""  # the head loaded for this placement's model, described ("" none)
    error: str = ""  # why it did not load


def why_no_mtp(mtp: MTPState) -> str:
    """Why the MTP head cannot draft here ("" when it can)."""
    if not mtp.present:
        return "no MTP head"
    if not mtp.whole:
        return "the model is split (its MTP head drafts only where one node holds every layer)"
    if mtp.steps_batched:
        return "decode steps of concurrent requests go through the model together here (lockstep)"
    if not mtp.loaded:
        return f"its MTP head did not load ({mtp.error or 'not loaded yet'})"
    return ""


def choose_drafter(mode: str, mtp: MTPState, *, batched: bool, draft: str = "") -> DrafterChoice:
    """The drafter for ``mode`` (the ``speculative`` setting). ``batched``: concurrent requests
    join one batch here (a lone request speculates beside it); ``draft``: the draft model loaded
    ("" none). "auto" and "mtp": the model's own head where it can draft, else what "auto" took
    before heads (prompt lookup, or nothing where requests batch)."""
    if mode == OFF:
        return DrafterChoice(OFF, 'speculative = "off"')
    if mode == DRAFT_MODEL:
        if draft:
            return DrafterChoice(DRAFT_MODEL, f"the draft model {draft}")
        return DrafterChoice(OFF, "the draft model did not load")
    if mode == PROMPT_LOOKUP:
        return DrafterChoice(PROMPT_LOOKUP, 'speculative = "prompt_lookup"')
    no = why_no_mtp(mtp)
    if not no:
        return DrafterChoice(MTP, f"the model's own head ({mtp.loaded})")
    if batched:
        return DrafterChoice(OFF, f"{no}, and requests batch here")
    return DrafterChoice(PROMPT_LOOKUP, no)
