"""Run a benchmark (``./dev bench [NAME] [ARGS]``); the default is the drain benchmark.

NAME is one of: drain (pyqmgr vs stock qmgr draining 5000 messages), decisions
(scheduling decisions per second with 10 to 100,000 jobs), memory (qmgr RSS with
20,000 active messages and with one 50,000-recipient message), replay (pyqmgr replay
of a synthetic day of 1,000,000 deliveries: time and peak memory), fidelity (replay
fitted on one real stock run, held against the others: needs root and Postfix), smtp
(pyqmgr vs stock qmgr delivering 1,500 messages to 15 SMTP sinks at 20 and 200 ms),
big (200 messages of 4 MB through discard, stock vs pyqmgr, and 1 KB ones), deadsite
(20,000 messages for a site that refuses connections, cycling for minutes: RSS, CPU),
bigqueue (200,000 messages in deferred/: the scans' time and the RSS; by hand), soak
(an hour of that dead site with fresh mail and reloads, side by side; by hand), sites
(50 domains at one 5-session server behind real MX records: stock, and pyqmgr with
sites), priority (password resets at 5 a second beside a 50,000-message newsletter:
stock, and pyqmgr with message classes), fleetrt (the fleet's Redis round trips per
delivery, this checkout's client against another's), metrics (the exporter with
100,000 sites and 100,000 destinations in core: a scrape's size and event-loop time),
scopes (the scheduler alone: a site at its limit with 30 to 100,000 member domains,
3 and 10,000 tenants on one transport), sitescale (one 10-session MX behind 30 and
3,000 domains, 1,000 and 10,000 queued, with sites and without: qmgr CPU a message).
"""

from __future__ import annotations

import sys

from benchmarks import (
    big_messages,
    big_queue,
    dead_site,
    decisions,
    drain,
    fidelity,
    fleet_roundtrip,
    memory,
    metrics_scale,
    priority,
    replay,
    scopes,
    site_scale,
    sites,
    smtp,
    soak,
)

BENCHMARKS = {"drain": drain.main, "decisions": decisions.main, "memory": memory.main,
              "replay": replay.main, "fidelity": fidelity.main, "smtp": smtp.main,
              "big": big_messages.main, "deadsite": dead_site.main,
              "bigqueue": big_queue.main, "soak": soak.main, "sites": sites.main,
              "fleetrt": fleet_roundtrip.main, "scopes": scopes.main,
              "sitescale": site_scale.main,
              "priority": priority.main, "metrics": metrics_scale.main}

if __name__ == "__main__":
    args = sys.argv[1:]
    name = args.pop(0) if args and args[0] in BENCHMARKS else "drain"
    sys.exit(BENCHMARKS[name](args))
