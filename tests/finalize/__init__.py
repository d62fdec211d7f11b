"""Tests of the finalize stage."""
