"""Transport parameters for unit tests of the core: stock's defaults, overridable."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Params:
    destination_concurrency_limit: int = 20
    destination_recipient_limit: int = 50
    initial_destination_concurrency: int = 5
    failed_cohort_limit: int = 1
    destination_rate_delay: int = 0
    transport_rate_delay: int = 0
    delivery_slot_cost: int = 5
    delivery_slot_loan: int = 3
    delivery_slot_discount: int = 50
    minimum_delivery_slots: int = 3
    recipient_limit: int = 20000
    extra_recipient_limit: int = 1000
    recipient_refill_limit: int = 100
    recipient_refill_delay: int = 5
    positive_feedback: str = "1"
    positive_feedback_name: str = "default_destination_concurrency_positive_feedback"
    negative_feedback: str = "1"
    negative_feedback_name: str = "default_destination_concurrency_negative_feedback"
