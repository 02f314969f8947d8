"""`mmcli review`: a local page to look at, filter and correct labeled records."""
