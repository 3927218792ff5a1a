"""The weather agent the Agents SDK tests run against a live server, through its Chat Completions model
(tests/server/test_agent_framework.py) and its default Responses model (test_responses_api_e2e.py)."""

from __future__ import annotations


def weather_agent(agents, model, cities: list[str]):
    """An agent that must call its one tool first; the tool records each city it is asked about."""
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return f"18 degrees and sunny in {city}"

    return agents.Agent(name="weather", instructions="Answer questions about the weather with the tools.",
                        model=model, tools=[get_weather],
                        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                            temperature=0, max_tokens=80))
