"""The family sweep, half 2 of 2 (tests/e2e/_family_sweep.py says what it proves)."""

from __future__ import annotations

import pytest
from _family_sweep import check_family
from kvscale_testing.families import HALVES

pytestmark = [pytest.mark.engine, pytest.mark.follows_cpu_fp8]


@pytest.mark.parametrize("family", HALVES[1], ids=lambda f: f.name)
def test_kvscale_serves_every_scale_stock_serves(family, tmp_path_factory):
    check_family(family, tmp_path_factory.mktemp("families"))
