"""The correctness rule, re-exported from ``fastattn.testing`` for the test modules that import ``rules``.

New tests import ``fastattn.testing`` directly.
"""
from fastattn.testing import (abs_errors, assert_half_within_1ulp, assert_within_rule, max_abs_error,  # noqa: F401
                              ulp_distance, within_half_1ulp, within_rule)
