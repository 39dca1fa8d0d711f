"""The OpenAI Agents SDK against a real `kvserve serve` (the demo checkpoint, random weights),
through its chat-completions model: the agent must call its function tool (forced on the
first turn), the SDK runs the tool and sends its result back, and the run ends with the
model's final answer (the SDK resets tool_choice to `auto` after a tool ran), an object of
the agent's `output_type` (the SDK sends `response_format` with the tools: the reply is
calls or JSON of the schema; a plain-text answer under `auto` is
tests/serve/test_tool_calls.py's)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

agents = pytest.importorskip("agents")


class Answer(BaseModel):
    zone: Literal["UTC", "CET"]
    hour: int = Field(ge=0, le=23)  # bounded: a random model writes digits until cut


def test_an_agent_runs_its_tool_and_answers_in_its_output_type(server):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time now in a time zone."""
        asked.append(zone)
        return f"12:00 in {zone}"

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
    agent = agents.Agent(
        name="clock",
        instructions="Answer with the time.",
        tools=[get_time],
        output_type=Answer,
        model=agents.OpenAIChatCompletionsModel(model=server.model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=96),
    )
    result = agents.Runner.run_sync(agent, "What time is it in Paris?", max_turns=3)
    assert len(asked) == 1 and asked[0] in ("UTC", "CET")  # the tool ran, with valid arguments
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [item.output for item in outputs] == [f"12:00 in {asked[0]}"]
    assert isinstance(result.final_output, Answer)  # the final answer, in its type
