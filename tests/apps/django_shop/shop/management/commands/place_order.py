from django.core.management.base import BaseCommand

from shop.services import place_order


class Command(BaseCommand):
    help = "Place an order (and enqueue its OrderPlaced event)."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("number", type=int)
        parser.add_argument("--fail", action="store_true")

    def handle(self, *args, number: int, fail: bool, **options):  # type: ignore[no-untyped-def]
        try:
            self.stdout.write(place_order(number, fail_after=fail))
        except RuntimeError as exc:
            self.stdout.write(f"rolled back: {exc}")
