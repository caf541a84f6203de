"""The surfaces: how a user reaches agentkv besides ``from agentkv import Session``.

``_cli`` (the ``agentkv`` command: demo, chat, bench, serve, models).
"""
