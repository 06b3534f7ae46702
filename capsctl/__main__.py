from capsctl.cli import main

main()
