"""pyqmgr.cf read once into typed, frozen tables, shared by the daemon, the simulator
and ``pyqmgr check`` (issue #44).

Each feature's settings were parsed in the daemon, and the simulator imported the
daemon to read a scenario's ``[pyqmgr_cf]`` the same way (13 daemon modules loaded
with its engine); tenant limits reached the core as raw strings it parsed again. Here
each feature's parameters are read and checked once, a bad value the same start-up
error wherever it is read, and what comes out is what the core is handed: typed
values (:class:`~pyqmgr.scheduler.structures.SiteTable`,
:class:`~pyqmgr.scheduler.tenant_cap.TenantLimitTable`, the policy table), never the
strings again.

- ``scheduling``: the scheduler's own parameters in one setup (policies, shaping,
  retry) and the response rules files they name;
- ``policies``: which policy ``scheduler_policy`` names, a built-in or a
  ``module:PATH`` file (the one place pyqmgr runs an admin's code);
- ``retry``: deferred mail's jitter and recovery settings, and the registry of which
  deferred files wait for which destination (the daemon's and the simulator's);
- ``sites``: provider sites (``site_grouping``, limits, provider tables and pins);
- ``classes``: message classes and tenants, and the classifier that gives each
  message its class and tenant from its envelope and the admin's tables;
- ``tenants``: each tenant's limits at a destination and a site, per transport.

Nothing here touches a queue, a socket or the daemon: it reads the files the
settings name (lookup tables, provider tables, pin files, rules files, policy
modules), which the daemon does at start-up, before the chroot.
"""
