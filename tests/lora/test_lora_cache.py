"""An adapter's KV blocks are keyed by its content (kvserve.lora.request): the same prompt
under two adapters shares no block, under one adapter it hits; a name reloaded with
other weights misses (vLLM #42125) and gives the new weights' tokens; two names for the
same weights share (vLLM #30931 is the opposite bug). Bad adapters are one-line errors
that leave the engine serving."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvserve import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import make_adapter

NEW = 6
PROMPT = [3, 17, 29, 41, 5, 8, 13, 21, 34, 2]  # two full blocks of 4 and a part


def tokens(llm: LLM, request: LoRARequest | None) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False, lora_request=request)
    return out[0].outputs[0].token_ids


def hits(llm: LLM) -> int:
    return llm.stats()["prefix_hit_tokens"]


@pytest.fixture
def llm(checkpoints):
    return LLM(checkpoints["llama"].path, block_size=4, num_kv_blocks=64, dtype="float32",
               num_threads=1, enable_lora=True, max_loras=2)  # fmt: skip


def test_two_adapters_share_no_block_and_one_adapter_hits(llm, llama_adapters):
    first, second = llama_adapters["all"], llama_adapters["attn"]
    tokens(llm, LoRARequest("all", 1, first.path))
    before = hits(llm)
    tokens(llm, LoRARequest("attn", 2, second.path))
    tokens(llm, None)
    assert hits(llm) == before  # neither the other adapter nor the base reads its blocks
    tokens(llm, LoRARequest("all", 1, first.path))
    assert hits(llm) == before + 8  # its own two full blocks


def test_two_names_for_the_same_weights_share_blocks(llm, llama_adapters):
    adapter = llama_adapters["all"]
    want = tokens(llm, LoRARequest("one-name", 1, adapter.path))
    before = hits(llm)
    assert tokens(llm, LoRARequest("another-name", 7, adapter.path)) == want
    assert hits(llm) == before + 8


def test_a_name_reloaded_with_other_weights_misses(checkpoints, llm, tmp_path):
    ck = checkpoints["llama"]
    old = make_adapter(ck, tmp_path / "old", seed=11)
    new = make_adapter(ck, tmp_path / "new", seed=12)
    live = tmp_path / "live"
    shutil.copytree(old.path, live)
    request = LoRARequest("tuned", 1, str(live))
    assert tokens(llm, request) == old.reference(PROMPT, NEW)
    before = hits(llm)
    shutil.rmtree(live)
    shutil.copytree(new.path, live)  # the same name and path, other weights
    assert tokens(llm, request) == new.reference(PROMPT, NEW)
    assert hits(llm) == before  # the old weights' blocks are not the new adapter's


def test_lora_request_needs_an_engine_with_enable_lora(checkpoints, llama_adapters):
    llm = LLM(checkpoints["llama"].path, block_size=4, num_kv_blocks=32, dtype="float32",
              num_threads=1)  # fmt: skip
    with pytest.raises(ValueError, match="enable_lora"):
        tokens(llm, LoRARequest("all", 1, llama_adapters["all"].path))


def broken(tmp_path, source, change) -> str:
    path = tmp_path / "broken"
    shutil.copytree(source, path)
    change(path)
    return str(path)


def edit_config(**fields):
    def change(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(fields)
        (path / "adapter_config.json").write_text(json.dumps(config))

    return change


def reshape_a_weight(path):
    tensors = load_file(path / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()  # a base model with another width
    save_file(tensors, path / "adapter_model.safetensors")


def pickle_only(path):
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")


BAD = {
    "missing": (lambda path: shutil.rmtree(path), "not a directory"),
    "pickle": (pickle_only, "pickle"),
    "rank": (edit_config(r=64), "exceeds max_lora_rank"),
    "dora": (edit_config(use_dora=True), "DoRA"),
    "target": (edit_config(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    "shape": (reshape_a_weight, "another base model"),
    "config": (lambda path: (path / "adapter_config.json").write_text("{"), "not JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_adapter_is_one_line_and_the_engine_goes_on(llm, llama_adapters, tmp_path, case):
    change, message = BAD[case]
    path = broken(tmp_path, llama_adapters["all"].path, change)
    with pytest.raises(ValueError, match=message) as info:
        tokens(llm, LoRARequest("bad", 3, path))
    assert "\n" not in str(info.value)
    good = llama_adapters["attn"]
    assert tokens(llm, LoRARequest("attn", 2, good.path)) == good.reference(PROMPT, NEW)


@pytest.mark.parametrize(
    "args", [("", 1, "/x"), ("a", 0, "/x"), ("a", True, "/x")], ids=["name", "id", "bool-id"]
)
def test_lora_request_fields_are_checked(args):
    with pytest.raises(ValueError):
        LoRARequest(*args)
