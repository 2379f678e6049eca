"""Pickers: rank the scored candidates, best first (the router retries down the list).
Importing this package registers every picker in `router.policy.base.PICKERS`."""

from router.policy.pickers.cache_aware import CacheAwarePicker
from router.policy.pickers.max_score import MaxScorePicker
from router.policy.pickers.power_of_two import PowerOfTwoPicker
from router.policy.pickers.random_order import RandomPicker
from router.policy.pickers.round_robin import RoundRobinPicker
from router.policy.pickers.softmax import SoftmaxPicker

__all__ = [
    "CacheAwarePicker", "MaxScorePicker", "PowerOfTwoPicker", "RandomPicker", "RoundRobinPicker", "SoftmaxPicker",
]
