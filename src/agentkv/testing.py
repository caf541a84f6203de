"""Test doubles for agent code: a scripted engine for loop logic, no model needed; two "hosts" on one machine.

    from agentkv.testing import ScriptedEngine

    engine = ScriptedEngine(["Paris.", "Rome."])
    async with engine, Session(engine=engine) as s:
        assert (await s.run("Capital of France?")).text == "Paris."
    engine.assert_complete()

The doubles need nothing prepared: they report the model folder that ships with agentkv
(src/agentkv/_doubles/test_model/: the bundled model's tokenizer and chat template, no weights), read without
importing transformers. Writing tests with them: docs/integrations.md, "Testing your agent".

A scripted engine never claims anything about KV reuse: it reports every prompt token as
computed and returns no handle. Tests that claim the pair works use the real pair.

Both doubles honour `Sampling.stop` as vLLM does: the output ends at the token that completes
the first stop string, its token ids are kept up to that token, its text ends before the stop
string (or with it, given ``include_stop_str_in_output``), no text delta carries it, and the finish
reason is ``"stop"``. Like a real pair (whose D pins nothing for a request a stop string ended),
`HonestPairEngine` then returns no handle.

Of `SamplingOptions`, a scripted output stands for one sample whatever shapes the distribution
(``top_p``, ``top_k``, ``min_p``, the penalties, as ``temperature`` and ``seed``); an option whose
effect on the output a script cannot honour (``logprobs``, ``logit_bias``, ``allowed_token_ids``,
``bad_words``, ``structured_outputs``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, special-token
text) fails the step with `UserError` naming it, rather than being dropped.

`HonestPairEngine` is a test double of the pair's decode engine D that keeps the push-back rule
honest: it remembers the tokens each handle it issued holds, checks every handle pushed back to
it, and records any violation (`HonestPairEngine.assert_honest` raises them). It injects faults
on request (errors, deaths, malformed or expiring handles, declined reads, stalls).
"""

from ._doubles._honest_faults import MALFORMATIONS, Fault, Malformation
from ._doubles._honest_pair import HonestPairEngine, PushBackViolationError, StepRecord
from ._doubles._scripted import ScriptedEngine, UnconsumedScriptError, block_real_engines
from ._engines._netns import NamespacesUnavailableError, TwoHosts, two_hosts

__all__ = [
    "MALFORMATIONS",
    "Fault",
    "HonestPairEngine",
    "Malformation",
    "NamespacesUnavailableError",
    "PushBackViolationError",
    "ScriptedEngine",
    "StepRecord",
    "TwoHosts",
    "UnconsumedScriptError",
    "block_real_engines",
    "two_hosts",
]

for _obj in (
    HonestPairEngine,
    PushBackViolationError,
    StepRecord,
    ScriptedEngine,
    UnconsumedScriptError,
    block_real_engines,
):
    _obj.__module__ = __name__  # documented (and shown) where users import them
