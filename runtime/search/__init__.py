"""Tree search: the strategies, the paths and their scores, the controller that grows and prunes them,
the answers they reach and the tree sent out. Paths and scores, never tensors."""
