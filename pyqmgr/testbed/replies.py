"""The sink SMTP server's own replies, apart from the sink.

:mod:`pyqmgr.compare.figures` counts a run's deferrals by the reply the sink gave, so it
needs these strings, and replay reads figures on a base install, where the sink's
aiosmtpd (the testbed extra) is absent. Kept here, importing nothing, both can share
them.
"""

ACCEPT_RCPT = "250 2.1.5 OK"
ACCEPT_DATA = "250 2.0.0 queued"
#: The per-client session limit's refusal (``client_limit``).
TOO_MANY = "421 4.7.0 too many connections from your host"
#: The rate limit's refusal (``rate_limit``), unless a ``rate_reply`` replaces it.
RATE_LIMITED = ("421 4.7.28 Our system has detected an unusual rate of mail from your "
                "IP address; try again later")
