"""Test support for ckptio and for anyone writing a backend for it.

Owns: ``io_conformance`` (the checks every IOBackend must pass, usable from pytest as a base class
to subclass with a backend factory, or as plain functions) and ``faults`` (an IOBackend wrapper
that fails chosen calls, to show that a failing save commits nothing and a failing load leaks
nothing). Nothing here is imported by ckptio itself; pytest is needed only by the base class.
"""
