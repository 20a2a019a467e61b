"""The example's repositories: one small project per task, each with a bug at its base commit, the Debian
packages it needs beyond the shared base (its own dependencies, in its own image only), the hidden tests
that fail on the bug and pass once it is fixed (``tests``: what the test patch adds), and the fix.

``build_images.py`` turns each into a git repository at ``/testbed`` in its image and a SWE-bench instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Repo:
    instance_id: str
    repo: str
    packages: tuple[str, ...]  # Debian packages this repository needs (its image only)
    files: dict[str, str]  # the base commit: path -> text
    tests: dict[str, str]  # the test patch: path -> the file's new text
    fix: dict[str, str]  # the gold patch: path -> the file's new text
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    problem_statement: str
    extra: dict[str, str] = field(default_factory=dict)


PYTEST_INI = "[pytest]\npythonpath = .\n"

# -- acme/settings: YAML settings over defaults (python3-yaml) ---------------------------------------------

SETTINGS = '''"""Settings read from YAML, over the defaults."""

import copy

import yaml

DEFAULTS = {"server": {"host": "127.0.0.1", "port": 8080}, "debug": False}


def load(text):
    """The defaults with the YAML document ``text`` over them."""
    settings = copy.deepcopy(DEFAULTS)
    settings.update(yaml.safe_load(text) or {})
    return settings
'''

SETTINGS_FIXED = '''"""Settings read from YAML, over the defaults."""

import copy

import yaml

DEFAULTS = {"server": {"host": "127.0.0.1", "port": 8080}, "debug": False}


def _merge(base, over):
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def load(text):
    """The defaults with the YAML document ``text`` over them."""
    return _merge(copy.deepcopy(DEFAULTS), yaml.safe_load(text) or {})
'''

SETTINGS_TESTS = '''from settings import load


def test_top_level_value_overrides_the_default():
    assert load("debug: true")["debug"] is True
'''

SETTINGS_TESTS_NEW = SETTINGS_TESTS + '''

def test_nested_defaults_are_kept():
    assert load("server:\\n  port: 9000\\n")["server"] == {"host": "127.0.0.1", "port": 9000}
'''

# -- acme/billing: billing periods with dateutil (python3-dateutil) ----------------------------------------

BILLING = '''"""Billing periods."""

import datetime

from dateutil.relativedelta import relativedelta


def next_invoice(day, months=1):
    """The invoice date ``months`` calendar months after ``day`` (the month's last day when shorter)."""
    return day + datetime.timedelta(days=30 * months)


def period_days(start, months=1):
    return (start + relativedelta(months=months) - start).days
'''

BILLING_FIXED = BILLING.replace("return day + datetime.timedelta(days=30 * months)",
                                "return day + relativedelta(months=months)")

BILLING_TESTS = '''import datetime

from billing import period_days


def test_january_has_31_days():
    assert period_days(datetime.date(2026, 1, 1)) == 31
'''

BILLING_TESTS_NEW = BILLING_TESTS.replace("from billing import period_days",
                                          "from billing import next_invoice, period_days") + '''

def test_next_invoice_is_a_calendar_month_later():
    assert next_invoice(datetime.date(2026, 3, 15)) == datetime.date(2026, 4, 15)


def test_next_invoice_after_the_31st_is_the_last_day_of_a_shorter_month():
    assert next_invoice(datetime.date(2028, 1, 31)) == datetime.date(2028, 2, 29)
'''

# -- acme/slugs: URL slugs with unidecode (python3-unidecode) ----------------------------------------------

SLUGS = '''"""URL slugs."""

import re

from unidecode import unidecode


def slugify(title):
    """``title`` as lowercase ASCII words joined by single dashes."""
    text = unidecode(title).lower()
    return re.sub(r"[^a-z0-9]", "-", text)
'''

SLUGS_FIXED = SLUGS.replace('return re.sub(r"[^a-z0-9]", "-", text)',
                            'return re.sub(r"[^a-z0-9]+", "-", text).strip("-")')

SLUGS_TESTS = '''from slugs import slugify


def test_accents_are_transliterated():
    assert slugify("Creme") == slugify("Crème") == "creme"
'''

SLUGS_TESTS_NEW = SLUGS_TESTS + '''

def test_words_are_joined_by_one_dash():
    assert slugify("Crème Brûlée, again!") == "creme-brulee-again"
'''

# -- acme/ledger: a text report with tabulate (python3-tabulate) -------------------------------------------

LEDGER = '''"""A ledger's report as a text table."""

from tabulate import tabulate


def total(rows):
    return sum(amount for _, amount in rows[:-1])


def report(rows):
    """A table of (item, amount) rows and their total."""
    return tabulate([*rows, ("total", total(rows))], headers=["item", "amount"])
'''

LEDGER_FIXED = LEDGER.replace("for _, amount in rows[:-1])", "for _, amount in rows)")

LEDGER_TESTS = '''from ledger import report


def test_the_report_has_a_header():
    assert report([("tea", 3)]).splitlines()[0].split() == ["item", "amount"]
'''

LEDGER_TESTS_NEW = LEDGER_TESTS.replace("from ledger import report", "from ledger import report, total") + '''

def test_total_counts_every_row():
    assert total([("tea", 3), ("cake", 4)]) == 7


def test_the_report_ends_with_the_total():
    assert report([("tea", 3), ("cake", 4)]).splitlines()[-1].split() == ["total", "7"]
'''

REPOS = [
    Repo("acme__settings-1", "acme/settings", ("python3-yaml",),
         {"settings.py": SETTINGS, "tests/test_settings.py": SETTINGS_TESTS, "pytest.ini": PYTEST_INI},
         {"tests/test_settings.py": SETTINGS_TESTS_NEW}, {"settings.py": SETTINGS_FIXED},
         ("tests/test_settings.py::test_nested_defaults_are_kept",),
         ("tests/test_settings.py::test_top_level_value_overrides_the_default",),
         "Setting one nested value loses the others.\n\n`load('server:\\n  port: 9000\\n')['server']` is "
         "`{'port': 9000}`: the default host is gone. A nested section in the YAML should override only "
         "the keys it names and keep the other defaults."),
    Repo("acme__billing-1", "acme/billing", ("python3-dateutil",),
         {"billing.py": BILLING, "tests/test_billing.py": BILLING_TESTS, "pytest.ini": PYTEST_INI},
         {"tests/test_billing.py": BILLING_TESTS_NEW}, {"billing.py": BILLING_FIXED},
         ("tests/test_billing.py::test_next_invoice_is_a_calendar_month_later",
          "tests/test_billing.py::test_next_invoice_after_the_31st_is_the_last_day_of_a_shorter_month"),
         ("tests/test_billing.py::test_january_has_31_days",),
         "next_invoice drifts: the invoice after 2026-03-15 is dated 2026-04-14.\n\n"
         "next_invoice(day, months) should be the same day `months` calendar months later (the last day of "
         "the month when that month is shorter: 2028-01-31 -> 2028-02-29), not 30 days per month."),
    Repo("acme__slugs-1", "acme/slugs", ("python3-unidecode",),
         {"slugs.py": SLUGS, "tests/test_slugs.py": SLUGS_TESTS, "pytest.ini": PYTEST_INI},
         {"tests/test_slugs.py": SLUGS_TESTS_NEW}, {"slugs.py": SLUGS_FIXED},
         ("tests/test_slugs.py::test_words_are_joined_by_one_dash",),
         ("tests/test_slugs.py::test_accents_are_transliterated",),
         "Slugs have runs of dashes.\n\n`slugify('Crème Brûlée, again!')` gives `'creme-brulee--again-'`; "
         "it should be `'creme-brulee-again'`: words joined by one dash, none at either end."),
    Repo("acme__ledger-1", "acme/ledger", ("python3-tabulate",),
         {"ledger.py": LEDGER, "tests/test_ledger.py": LEDGER_TESTS, "pytest.ini": PYTEST_INI},
         {"tests/test_ledger.py": LEDGER_TESTS_NEW}, {"ledger.py": LEDGER_FIXED},
         ("tests/test_ledger.py::test_total_counts_every_row",
          "tests/test_ledger.py::test_the_report_ends_with_the_total"),
         ("tests/test_ledger.py::test_the_report_has_a_header",),
         "The ledger's total leaves out the last item.\n\n`total([('tea', 3), ('cake', 4)])` is 3, and the "
         "report's total line says 3; both should be 7."),
]
