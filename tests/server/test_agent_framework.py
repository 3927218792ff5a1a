"""An agent framework's tool loop against a live `ponder serve` on the embedded model: OpenAI's Agents
SDK (`openai-agents`, its Chat Completions model) asks with tool_choice required, runs the tool the
model called, sends the result back (as a `tool` message answering the call's id) and gets a final
answer with tool_choice reset to auto."""

from __future__ import annotations

import pytest

from tests.server.agent_tools import weather_agent
from tests.server.live import live_server

agents = pytest.importorskip("agents", reason="openai-agents is not installed (make install's dev extra has it)")


@pytest.fixture(scope="module")
def server():
    with live_server("--device", "cpu", env={"PONDER_CACHE__NUM_BLOCKS": "512"}) as (base, _):
        yield base


def test_an_agent_calls_a_tool_and_answers(server):
    from openai import AsyncOpenAI

    cities: list[str] = []
    model = agents.OpenAIChatCompletionsModel(model="SmolLM2-135M-Instruct",
                                              openai_client=AsyncOpenAI(base_url=server + "/v1", api_key="unused",
                                                                        max_retries=0))
    agent = weather_agent(agents, model, cities)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"]
    assert kinds[-1] == "MessageOutputItem"
    assert len(cities) == 1 and isinstance(cities[0], str) and cities[0]
    assert isinstance(result.final_output, str) and result.final_output
