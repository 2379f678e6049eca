"""Filters: drop candidates that must not serve a request. Importing this package
registers every filter in `router.policy.base.FILTERS`."""

from router.policy.filters.busy import BusyFilter
from router.policy.filters.healthy import HealthyFilter
from router.policy.filters.not_draining import NotDrainingFilter
from router.policy.filters.role import RoleFilter
from router.policy.filters.serves_model import ServesModelFilter

__all__ = ["BusyFilter", "HealthyFilter", "NotDrainingFilter", "RoleFilter", "ServesModelFilter"]
