"""Bounds on compiling one grammar (llguidance), shared by the gateway's check and the worker.

A grammar of a few bytes can still be ruinous: nested counted repetition such as
`((a{1000}){1000}){3}` forces millions of bytes, and llguidance's default lexer fuel lets the
first mask walk them (most of a second and ~150 MB per grammar). With the lexer's up-front fuel
lowered the same grammar fails fast instead ("too many expressions constructed") once the bytes
it forces are fed, so the bounded compile is: build the matcher under `parser_limits()`, compute the first
mask, feed up to `PROBE_FORCED_TOKENS` of the tokens the grammar forces and compute the next
mask. Ordinary grammars pass this in about a millisecond, with the same masks (and greedy
outputs) as under the default limits.

llguidance is imported when first needed: this module is importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance

# LLParserLimits fields. initial_lexer_fuel (default 1M) bounds the regex analysis done up front
# and the number of regex expressions the lexer may build for the grammar: the cost of the
# ruinous grammars, which this bound turns into an error, grows with it. It still admits JSON
# schemas of a few hundred properties and tool sets of dozens of tools (tests pin examples).
# max_lexer_states bounds the lexer's memory (1-2 kB a state; default 250k). The rest keep
# llguidance's defaults, which already bound each mask step.
INITIAL_LEXER_FUEL = 50_000
MAX_LEXER_STATES = 50_000
PROBE_FORCED_TOKENS = 64


def parser_limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                     max_lexer_states=MAX_LEXER_STATES)


def probe(matcher: llguidance.LLMatcher) -> str:
    """Runs the bounded compile's first steps on `matcher` (which it advances: pass a copy);
    returns the error ("" when the grammar is within bounds)."""
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        forced = matcher.compute_ff_tokens()[:PROBE_FORCED_TOKENS]
        if forced:
            matcher.consume_tokens(forced)
        if forced and not matcher.is_error():
            matcher.compute_bitmask()
    return matcher.get_error() if matcher.is_error() else ""
