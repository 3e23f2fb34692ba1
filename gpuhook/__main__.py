from gpuhook.entry import main

main()
