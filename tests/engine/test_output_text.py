"""Output text in the step API: vLLM's semantics, text growing step by step, DELTA outputs."""

from __future__ import annotations

import pytest
from _runs import run

from kvserve.batch import SeqChunk, StepOutput
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.outputs import CompletionOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)
KINDS = (CUMULATIVE, DELTA, FINAL)


class ScriptedRunner(ModelFreeRunner):
    """Samples a fixed script per sequence (`rid#i`) or user request (`rid`), with a tokenizer."""

    def __init__(self, tokenizer, scripts: dict[str, list[int]]) -> None:
        super().__init__(num_blocks=64, hash_block_size=4)
        self.tokenizer = tokenizer
        self.eos_token_ids = {tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        self.scripts = scripts

    def execute(self, chunks: list[SeqChunk]) -> StepOutput:
        scripts = self.scripts
        return StepOutput(
            [
                (scripts.get(c.request_id) or scripts[c.request_id.split("#")[0]])[c.num_generated]
                if c.sample
                else None
                for c in chunks
            ]
        )


def scripted_engine(tokenizer, scripts: dict[str, list[int]]) -> LLMEngine:
    return LLMEngine.from_runner(ScriptedRunner(tokenizer, scripts), EngineArgs(block_size=4))


def scripted(tokenizer, text: str, *extra: int) -> list[int]:
    return [*tokenizer.encode(text), *extra]


def each_kind(tokenizer, script: list[int], **params) -> dict[RequestOutputKind, list]:
    """One request of each output kind on the same script: the outputs of each."""
    engine = scripted_engine(tokenizer, {kind.name: script for kind in KINDS})
    params.setdefault("max_tokens", len(script))
    for kind in KINDS:
        engine.add_request(kind.name, [5, 6, 7], SamplingParams(output_kind=kind, **params))
    outputs = run(engine)
    return {kind: outputs[kind.name] for kind in KINDS}


def final_completion(tokenizer, script: list[int], **params):
    """The final completion, after checking that the three kinds agree on it."""
    outs = each_kind(tokenizer, script, **params)
    final = outs[FINAL][-1].outputs[0]
    assert len(outs[FINAL]) == 1
    assert outs[CUMULATIVE][-1].outputs[0] == final
    deltas = [o.outputs[0] for o in outs[DELTA]]
    assert "".join(c.text for c in deltas) == final.text
    assert [t for c in deltas for t in c.token_ids] == final.token_ids
    assert all(final.text.startswith(o.outputs[0].text) for o in outs[CUMULATIVE])
    return final


def test_eos_text_is_left_out_but_its_token_stays(demo_tokenizer):
    eos = demo_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    script = scripted(demo_tokenizer, "Hello wörld", eos, 7, 8)
    plain = final_completion(demo_tokenizer, script, skip_special_tokens=False)
    assert (plain.text, plain.token_ids[-1], plain.finish_reason) == ("Hello wörld", eos, "stop")
    assert plain.stop_reason is None
    shown = final_completion(
        demo_tokenizer, script, skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert shown.text == "Hello wörld<|endoftext|>" and shown.token_ids == plain.token_ids


def test_a_stop_token_id_is_left_out_and_named(demo_tokenizer):
    im_end = demo_tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = scripted(demo_tokenizer, "Hi €", im_end, 7, 8)
    done = final_completion(
        demo_tokenizer, script, skip_special_tokens=False, stop_token_ids=[im_end]
    )
    assert (done.text, done.token_ids[-1], done.stop_reason) == ("Hi €", im_end, im_end)


def test_special_tokens_show_unless_skipped(demo_tokenizer):
    im_start = demo_tokenizer.convert_tokens_to_ids("<|im_start|>")
    script = scripted(demo_tokenizer, "a", im_start, *demo_tokenizer.encode("b 😀"))
    assert final_completion(demo_tokenizer, script).text == "ab 😀"
    shown = final_completion(demo_tokenizer, script, skip_special_tokens=False)
    assert shown.text == "a<|im_start|>b 😀" and shown.finish_reason == "length"


@pytest.mark.parametrize(
    ("stop", "include", "text", "reason"),
    [
        (["STOP"], False, "one, two, ", "STOP"),
        (["STOP"], True, "one, two, STOP", "STOP"),
        (["wörld"], False, "one, two, STOP ", "wörld"),  # ö is split over two tokens
        (["ÿ"], False, "one, two, STOP wörld, capital three", None),  # never: length
        # Both complete in the token " capital": the one completed first wins.
        (["capital", "pit"], False, "one, two, STOP wörld, ca", "pit"),
        (["capital", "pit"], True, "one, two, STOP wörld, capit", "pit"),
    ],
)
def test_stop_strings_are_cut_unless_included(demo_tokenizer, stop, include, text, reason):
    script = scripted(demo_tokenizer, "one, two, STOP wörld, capital three")
    assert demo_tokenizer.encode(" capital") == [script[-2]]
    done = final_completion(demo_tokenizer, script, stop=stop, include_stop_str_in_output=include)
    assert (done.text, done.stop_reason) == (text, reason)
    assert done.finish_reason == ("stop" if reason else "length")


def test_a_stop_string_in_the_first_min_tokens_is_not_matched(demo_tokenizer):
    script = scripted(demo_tokenizer, "ab ab ab")
    first = len(demo_tokenizer.encode("ab ab"))
    done = final_completion(demo_tokenizer, script, stop=["ab"], min_tokens=first)
    assert done.text == "ab ab " and done.stop_reason == "ab"


def test_delta_never_shows_text_a_stop_string_takes_back(demo_tokenizer):
    script = [t for c in "xSTOxSTOP!" for t in demo_tokenizer.encode(c)]  # one token a char
    outs = each_kind(demo_tokenizer, script, stop=["STOP"])
    assert [o.outputs[0].text for o in outs[DELTA]] == ["", "", "", "x", "S", "T", "O", "x", ""]
    assert outs[FINAL][0].outputs[0].text == "xSTOx"


def test_only_requests_that_read_text_during_the_run_detokenize(demo_tokenizer):
    script = scripted(demo_tokenizer, "some text")
    engine = scripted_engine(demo_tokenizer, {"a": script, "b": script})
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=3, output_kind=FINAL))
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=3, output_kind=DELTA))
    a, b = engine.scheduler.waiting
    assert a.output_text is None and b.output_text is not None
    outputs = run(engine)
    assert outputs["a"][0].outputs[0].text == demo_tokenizer.decode(script[:3])


def test_n_completions_stream_deltas_each(demo_tokenizer):
    script = scripted(demo_tokenizer, "n > 1: ✓ done")
    eos = demo_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    short = scripted(demo_tokenizer, "✓", eos)
    engine = scripted_engine(demo_tokenizer, {"r#0": script, "r#1": short})
    engine.add_request(
        "r", [1, 2, 3], SamplingParams(n=2, max_tokens=len(script), output_kind=DELTA)
    )
    outs = run(engine)["r"]
    assert len(outs) == len(script) and outs[-1].finished
    texts = ["".join(o.outputs[i].text for o in outs) for i in (0, 1)]
    assert texts == ["n > 1: ✓ done", "✓"]
    assert [t for o in outs for t in o.outputs[1].token_ids] == short
    # Once finished, the short one is in every output, with nothing new.
    assert outs[-1].outputs[1] == CompletionOutput(1, "", [], "stop", None)


def test_without_a_tokenizer_text_stays_empty():
    runner = ModelFreeRunner(num_blocks=32, hash_block_size=4)
    engine = LLMEngine.from_runner(runner, EngineArgs(block_size=4))
    for kind in KINDS:
        engine.add_request(kind.name, [1, 2, 3], SamplingParams(max_tokens=4, output_kind=kind))
    outs = run(engine)
    assert {o.outputs[0].text for kind in KINDS for o in outs[kind.name]} == {""}
    assert [t for o in outs["DELTA"] for t in o.outputs[0].token_ids] == (
        outs["FINAL_ONLY"][0].outputs[0].token_ids
    )


def test_new_fields_are_validated():
    for field in ("skip_special_tokens", "include_stop_str_in_output"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: "yes"})


def test_streamed_text_of_a_random_model_adds_up(demo_model, demo_tokenizer):
    """The demo's random weights sample stray and split UTF-8 bytes: deltas wait for them."""
    engine = LLMEngine(
        demo_model,
        EngineArgs(block_size=4, num_kv_blocks=256, dtype="float32", device="cpu", num_threads=1),
    )
    for seed in range(4):
        for kind in KINDS:
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=48, output_kind=kind)
            engine.add_request(f"{seed}{kind.name}", [3 + seed, 40, 50, 60], params)
    outputs = run(engine)
    waited = 0
    for seed in range(4):
        final = outputs[f"{seed}FINAL_ONLY"][-1].outputs[0]
        deltas = [o.outputs[0] for o in outputs[f"{seed}DELTA"]]
        cumulative = [o.outputs[0] for o in outputs[f"{seed}CUMULATIVE"]]
        ids = final.token_ids
        if final.finish_reason == "stop":  # EOS: its text is not part of the output
            ids = ids[:-1]
        assert final.text == demo_tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(d.text for d in deltas) == final.text == cumulative[-1].text
        assert [t for d in deltas for t in d.token_ids] == final.token_ids
        assert all(final.text.startswith(c.text) for c in cumulative)
        at = 0
        for d in deltas:  # a U+FFFD in a piece is one the final text has there
            assert d.text == final.text[at : at + len(d.text)]
            at += len(d.text)
        waited += sum(1 for d in deltas if d.token_ids and not d.text)
    assert waited > 0  # some tokens ended inside a character: their text came later
