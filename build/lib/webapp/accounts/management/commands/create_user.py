from django.core.management.base import BaseCommand, CommandError

from webapp.accounts.services import api_token_get_or_create, user_create


class Command(BaseCommand):
    help = "Create a user (there is no open sign-up). Prints the user's API token."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--password", required=True)
        parser.add_argument("--email", default="")
        parser.add_argument("--staff", action="store_true")
        parser.add_argument("--team", action="append", default=[], help="team name (repeatable)")

    def handle(self, *args, username, password, email, staff, team, **options):
        try:
            user = user_create(username=username, password=password, email=email, is_staff=staff, team_names=tuple(team))
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"created {user.username}; API token: {api_token_get_or_create(user=user)}")
