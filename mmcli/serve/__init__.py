"""`mmcli serve` and `mmcli batch`: the labeling engine behind the OpenAI API."""
