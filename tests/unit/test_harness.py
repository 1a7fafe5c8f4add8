"""compat.harness.normalize: ids, pids and delays do not count as differences."""

from compat.harness import normalize
from pyqmgr.testbed.maillog import parse_line


def test_two_runs_normalise_alike():
    a = parse_line("Nov 22 10:48:39 pfx postfix/discard[6815]: 10AEC20E202: to=<u@d>, "
                   "relay=none, delay=0.01, delays=0/0/0/0.01, dsn=2.0.0, status=sent (d)")
    b = parse_line("Nov 22 11:00:00 pfx postfix/discard[9]: 4B43D20C842: to=<u@d>, "
                   "relay=none, delay=1.2, delays=1/0.2/0/0, dsn=2.0.0, status=sent (d)")
    assert normalize(a, {}) == normalize(b, {}) == (
        "postfix/discard: Q1: to=<u@d>, relay=none, delay=*, delays=*, dsn=2.0.0, "
        "status=sent (d)")


def test_ids_are_numbered_in_order_of_appearance():
    ids: dict[str, str] = {}
    first = parse_line("Nov 22 10:48:39 pfx postfix/bounce[1]: 66BB720C0C3: sender "
                       "non-delivery notification: 6910320C0C7")
    assert normalize(first, ids).endswith("Q1: sender non-delivery notification: Q2")
