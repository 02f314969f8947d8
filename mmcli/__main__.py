from mmcli.cli.app import app

app()
