"""Gate self-test: planted defects that prove each gate can catch what it exists to catch.

``catalogue`` declares the defects, ``wrappers`` and ``engine`` plant them into copies of the
selected routes, ``slowdown`` makes a planted slowdown cost what it claims on this machine,
``session`` wires them into a pytest run, ``child`` runs that pytest session for the
``pytest-dflash selftest`` command (an interrupt reaches it once, and its report is kept), and
``summary`` turns the outcomes into the report's
``selftest`` section. See ``docs/selftest.md``.
"""
