"""Structured outputs: a request's output held to a JSON schema, a regex, an EBNF grammar or an
xgrammar structural tag (tool calls), under speculative decoding exactly as without it.

xgrammar (vLLM's default structured-output engine) compiles the structure against the tokenizer's
vocabulary once, and its matcher gives the allowed next tokens as a cheap bitmask and
rolls back accepted tokens: what verifying a draft tree needs.

Each step, :meth:`Constraint.prune` walks the draft tree with the matcher: a node whose token the
grammar refuses is cut with its subtree before the target forward (it could never be accepted), and
every surviving node gets the mask of the token after it. Verification masks the target's logits
of each node with its row, so the accepted path and the next token are what constrained decoding
without a draft would emit; the matcher itself only advances with the tokens a step emits
(:meth:`Constraint.advance`), and the walk leaves it where it was.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import torch

from ..drafters.base import Draft
from ..verification.tree import tree_children

KINDS = ("json_object", "json_schema", "structural_tag", "regex", "grammar")


class Grammars:
    """Compiles request structures for one tokenizer (xgrammar caches what it compiled)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.tokenizer, self.vocab_size, self.stops = tokenizer, vocab_size, sorted(set(stop_token_ids))
        self._compiler = None

    @property
    def compiler(self):
        if self._compiler is None:  # the vocabulary scan costs ~0.15 s: only for a server that is asked
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stops
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, structure: dict):
        """The compiled grammar of ``structure`` (see ``SamplingParams.structure``); ValueError when it
        is malformed or does not compile. JSON is written without free whitespace (``", "`` and
        ``": "`` between items): small models given free whitespace may emit it forever."""
        kind = structure.get("type") if isinstance(structure, dict) else None
        if kind not in KINDS:
            raise ValueError(f"unknown output structure type {kind!r} (one of {', '.join(KINDS)})")
        c = self.compiler
        try:
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                return c.compile_json_schema(json.dumps(structure["schema"]), any_whitespace=False)
            if kind == "structural_tag":
                return c.compile_structural_tag(json.dumps({"type": "structural_tag", "format": structure["format"]}))
            if kind == "regex":
                return c.compile_regex(structure["pattern"])
            return c.compile_grammar(structure["ebnf"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the output structure ({kind}) does not compile: {e}") from None

    def constraint(self, structure: dict) -> Constraint:
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(self.compile(structure)), self.vocab_size, self.encode)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


class Constraint:
    """One request's grammar state: the tokens emitted so far, matched."""

    def __init__(self, matcher, vocab_size: int, encode=None):
        self.matcher, self.vocab_size, self.encode = matcher, vocab_size, encode

    def extend(self, draft: Draft, room: int) -> Draft:
        """The draft continued, at the end of its main path (first children from the root: a chain's
        whole length), by the text the grammar forces there (a JSON key that must come next, the rest
        of a tool call's tag), tokenised, up to ``room`` nodes in all: the grammar drafts what it
        already knows, and the target verifies it like any draft. Else the draft as it is."""
        if self.encode is None or len(draft) >= room or draft.dists is not None:
            return draft
        m, children = self.matcher, tree_children(draft.parents)
        node, depth = 0, 0  # node: 0 the root, i + 1 draft node i
        while children[node]:
            c = children[node][0]
            if not m.accept_token(draft.token_ids[c]):
                m.rollback(depth)
                return draft  # the grammar refuses the path: prune cuts it
            node, depth = c + 1, depth + 1
        forced = m.find_jump_forward_string() if not m.is_terminated() else ""
        m.rollback(depth)
        if not forced:
            return draft
        more = self.encode(forced)[: room - len(draft)]
        n = len(draft)
        parents = [node - 1] + list(range(n, n + len(more) - 1))
        return Draft(
            draft.token_ids + more,
            draft.parents + parents,
            (draft.probs or [1.0] * n) + [1.0] * len(more),
            draft.score,
            draft.match_len,
            f"{draft.source}+grammar" if draft.source else "grammar",
            None,
            draft.setup_s,
            draft.marks + [False] * len(more) if draft.marks is not None else None,
        )

    def prune(self, draft: Draft) -> tuple[Draft, torch.Tensor]:
        """(``draft`` less the nodes the grammar refuses, with their subtrees; the allowed-token
        bitmask of each position it verifies: row 0 after the context, row i+1 after node i)."""
        import xgrammar as xgr

        m, toks = self.matcher, draft.token_ids
        children = tree_children(draft.parents)
        bits = xgr.allocate_token_bitmask(len(toks) + 1, self.vocab_size)
        kept: list[int] = []

        def visit(row: int) -> None:
            if m.is_terminated():  # after a stop token: whatever follows is cut by the engine anyway
                bits[row] = -1
                return
            m.fill_next_token_bitmask(bits, row)
            for c in children[row]:
                if m.accept_token(toks[c]):
                    kept.append(c)
                    visit(c + 1)
                    m.rollback(1)

        visit(0)
        if len(kept) == len(toks):
            return draft, bits
        kept.sort()  # tree order: parents before children
        return draft.kept(kept), bits[[0] + [c + 1 for c in kept]]

    def advance(self, tokens: Sequence[int]) -> None:
        """Match the tokens a step emitted; each was drawn from a masked row, so a refusal is a bug."""
        for t in tokens:
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"the grammar refused emitted token {t}")


def apply_mask(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """Set the logits of the tokens ``bits`` disallows to -inf, in place (``logits [n, V]`` float32
    on any device, ``bits`` from :meth:`Constraint.prune`, on the CPU)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bits.to(logits.device), vocab_size=logits.shape[-1])
