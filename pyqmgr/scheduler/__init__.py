"""The I/O-free scheduling core.

Plain Python objects named after the structures of Postfix's scheduler (transport,
queue, entry, job, peer, message). Time is always passed in and nothing here does I/O:
no module imports ``os``, ``socket``, ``time``, ``asyncio`` or any other standard
module that is not pure computation, calls ``open`` or reads a file through a helper
(tests/unit/test_architecture.py holds the rule), so the daemon, the simulator and the
unit tests can all drive the same code. pyqmgr.cf reaches the core parsed, as typed
tables (:mod:`pyqmgr.settings`).

What lives where, as ``qmgr.h`` says it for stock's ``src/qmgr/``:

- ``structures``: the structures that name each other (``Entry``, ``Queue``,
  ``Transport``, ``Dsn``) and ``Backend``, what the core asks of a policy;
  ``message``: a message's scheduling state, its recipients and their routes;
- ``core``: ``Scheduler``, the state (``state.Core`` is how the verbs see it) and one
  method per event, each returning a ``decisions.Decisions`` value;
- the verbs, beside what they change: ``entry`` (select, unselect, finish, move),
  ``queue`` (queues into and out of core), ``transport`` (agent allocation),
  ``reading`` (how many recipients to read, filing them), ``deliver`` (an agent's entry
  and its reply's feedback), ``defer`` (dead destinations and transports), ``enable``
  (reviving them), ``gates`` (suspensions' and shaping's gates), ``controls`` (suspend,
  resume, retry), ``recovery`` (deferred mail waiting for a destination), ``delegation``
  (a policy service's answers), ``throttling`` (what another server of a fleet found
  dead or throttled);
- the scopes beyond a destination, reached by one road: ``scope`` (the walk of a
  delivery's chain of ``structures.ScopeKind``), ``site`` (a provider's site), and
  ``tenant_cap`` with ``tenant_scope`` (a tenant's caps at a destination and a site);
- the policies: ``policy`` (the ``Policy`` base, the table of which transport runs
  which; an admin's ``module:`` file is loaded by :mod:`pyqmgr.settings.policies`),
  ``nqmgr`` (stock's, the default), ``oqmgr``, ``finch``, ``zmailer``; the core names
  none of them;
- their helpers: ``feedback`` (concurrency feedback), ``shaping`` (rates and response
  rules), ``suspension`` (operators' suspensions), ``qlist`` (stock's O(1) lists),
  ``explain`` (why mail waits, for ``pyqmgr explain``).
"""
