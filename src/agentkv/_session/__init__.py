"""The session layer: a conversation pinned to its KV, run turn by turn.

``_session`` (the Session and its lifecycle), ``_session_config`` (the frozen arguments),
``_turn`` (one turn as named steps; the push-back rule it obeys is ``agentkv._engines._pinning``), ``_results`` (what
a turn returns and streams). The public names are re-exported by ``agentkv``.
"""
