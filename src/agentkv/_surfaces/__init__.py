"""The surfaces: how a user reaches agentkv besides ``from agentkv import Session``.

``_cli`` (the ``agentkv`` command: demo, chat, bench, serve, engine, smoke, models); ``_smoke`` (``agentkv smoke``).
"""
