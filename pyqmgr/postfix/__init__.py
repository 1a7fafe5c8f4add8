"""The layer that speaks Postfix: one module per Postfix concept.

Nothing here schedules; the daemon combines these modules with the scheduler core.
"""
