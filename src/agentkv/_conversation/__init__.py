"""The conversation layer: the token-exact history and the tools.

``_conversation`` (messages, the chat-template deltas, the token history), ``_tools``
(``@tool``, argument schemas, the schema-forced and native call formats, running calls).
"""
