"""Vocabulary-parallel autograd ops; the tensor-parallel group is always passed explicitly."""
