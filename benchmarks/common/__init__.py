"""What the studies share: launching ranks under torchrun (``launch``), a bandwidth-capped network of namespaces on
one host (``netns``, checked by ``netns_check``), and the repository's paths (``paths``)."""
