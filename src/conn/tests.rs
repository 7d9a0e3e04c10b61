// Placeholder: state-machine tests land here.
