"""agentkv as a model of the agent frameworks people already use.

One module per framework, each importing its framework (``import agentkv`` imports none):

* `agentkv.integrations.openai_agents`: ``AgentKVModel`` (and ``AgentKVProvider``) for openai-agents (``pip install agentkv-vllm[openai-agents]``);
* `agentkv.integrations.pydantic_ai`: ``AgentKVModel`` for pydantic-ai (``agentkv-vllm[pydantic-ai]``);
* `agentkv.integrations.langchain`: ``ChatAgentKV`` for LangChain and LangGraph (``agentkv-vllm[langchain]``).

Each runs every model call of a conversation on one pinned `agentkv.Session` (through a
`agentkv.SessionPool`) and returns the model's tool calls for the framework to run.
"""

from ._pooled import PooledModel

__all__ = ["PooledModel"]
