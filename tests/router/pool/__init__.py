"""Tests of router/pool/."""
