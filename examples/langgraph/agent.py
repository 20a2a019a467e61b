"""A LangGraph ReAct agent (LangChain's ChatOpenAI and a tool node), unmodified. It knows nothing of lgt.

ChatOpenAI calls ``POST {OPENAI_BASE_URL}/chat/completions`` (a hosted API under a reserved name that
never resolves); under lgt-proxy the call reaches the policy being trained. LangGraph's prebuilt ReAct
graph runs the loop: model → tool node (the calculator) → model, until the model answers in text. The
answer is graded here and printed as the last line: {"answer": "...", "turns": 2, "reward": 1.0}.
"""

import json
import os

from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    allowed = set("0123456789+-*/(). ")
    text = "".join(ch for ch in expression if ch in allowed).strip()
    try:
        return str(eval(text, {"__builtins__": {}}))  # digits and operators only
    except Exception:
        return "error"


def main() -> None:
    question = os.environ.get("TASK_QUESTION", "What is 23*47?")
    answer = os.environ.get("TASK_ANSWER", "1081")
    llm = ChatOpenAI(model="gpt-4o-mini", temperature=1.0, max_tokens=48)  # OPENAI_BASE_URL, _API_KEY
    graph = create_react_agent(llm, [calculator])
    try:
        state = graph.invoke({"messages": [("user", question)]}, {"recursion_limit": 8})
        replies = [m for m in state["messages"] if isinstance(m, AIMessage)]
        last = replies[-1]
        text, turns = str(last.content), len(replies)
        finish = last.response_metadata.get("finish_reason")
    except GraphRecursionError:  # the model kept calling the tool: a wrong answer, not a crash
        text, turns, finish = "", 4, None
    ok = finish == "stop" and text.strip() == f"The answer is {answer}."
    print(json.dumps({"answer": text, "turns": turns, "reward": 1.0 if ok else 0.0}))


if __name__ == "__main__":
    main()
