"""The session layer: a conversation pinned to its KV, run turn by turn.

``_session`` (the Session and its lifecycle), ``_session_config`` (the frozen arguments),
``_turn`` (one turn as named steps), ``_pinning`` (the push-back rule), ``_results`` (what
a turn returns and streams). The public names are re-exported by ``agentkv``.
"""
